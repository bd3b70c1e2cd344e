"""One all-reduce between CPU ranks on this machine: through shared memory (parallel.shared_memory)
against gloo's, side by side in the same processes, at the sizes SmolLM2's layers sum (a decode
step's rows, a prompt's), one torch thread per rank.

    .venv/bin/python -m bench.all_reduce --ranks 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import machine
from parallel import comm

HIDDEN = 576  # SmolLM2's
SIZES = [(1, torch.bfloat16), (4, torch.bfloat16), (512, torch.float32), (2048, torch.float32)]


def _rank(rank: int, world: int, port: int, calls: int) -> None:
    torch.set_num_threads(1)
    comm.init_process_group("127.0.0.1", port, rank, world, "gloo", timeout_s=60.0)
    shared = comm.TensorGroup()
    shared.share_memory()
    gloo = comm.TensorGroup()  # the same group, summing through torch.distributed
    for rows, dtype in SIZES:
        x = torch.randn(rows, HIDDEN).to(dtype)
        times = {}
        for name, group in (("shared", shared), ("gloo", gloo)):
            for _ in range(max(5, calls // 10)):
                group.all_reduce(x)
            dist.barrier()
            spans = []
            for _ in range(calls):
                started = time.perf_counter()
                group.all_reduce(x.fill_(1.0))
                spans.append(time.perf_counter() - started)
            times[name] = spans
        if rank == 0:
            med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
            mean = {k: statistics.fmean(v) * 1e6 for k, v in times.items()}
            print(f"{rows:>5} x {HIDDEN} {str(dtype).split('.')[1]:>8} "
                  f"{med['shared']:>10.1f} {mean['shared']:>9.1f} {med['gloo']:>9.1f} "
                  f"{mean['gloo']:>9.1f} {med['gloo'] / med['shared']:>7.1f}x", flush=True)
    comm.destroy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--calls", type=int, default=400)
    args = ap.parse_args()
    print(f"{machine()}; {args.ranks} ranks, one thread each; microseconds a call (rank 0)")
    print(f"{'rows':>14} {'dtype':>8} {'shared med':>10} {'mean':>9} {'gloo med':>9} "
          f"{'mean':>9} {'gloo/sh':>8}")
    mp.spawn(_rank, args=(args.ranks, comm.free_port(), args.calls), nprocs=args.ranks)


if __name__ == "__main__":
    main()
