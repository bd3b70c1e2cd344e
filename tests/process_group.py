"""Run a test's function in several real processes joined by one gloo process group, as the
engine's ranks are (comm.init_process_group), without Ray."""
from __future__ import annotations

import torch
import torch.multiprocessing as mp

from parallel import comm


def _in_group(rank: int, world: int, port: int, body, args: tuple) -> None:
    torch.set_num_threads(1)
    comm.init_process_group("127.0.0.1", port, rank, world, "gloo", timeout_s=60.0)
    try:
        body(rank, world, *args)
    finally:
        comm.destroy()


def run_in_group(world: int, body, *args) -> None:
    """body(rank, world, *args) in `world` processes of one group; a raise in any fails it.
    `body` must be a module-level function (the processes are spawned)."""
    mp.spawn(_in_group, args=(world, comm.free_port(), body, args), nprocs=world)
