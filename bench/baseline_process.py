"""transformers in a process of its own, driven by the benchmark that compares the engine with it.

Both use OpenMP (libgomp) for their parallel ops. Two threads of one process that each run
parallel regions (the engine's step loop and a caller running transformers) make libgomp stop
spinning between regions in both, and each then runs ~30 % slower than alone. Neither system is
run that way in practice, so each gets a process: this one, and the benchmark's. The benchmark
still alternates their runs, so a slow spell of the machine hits both alike.
"""
from __future__ import annotations

import multiprocessing as mp
from typing import Any, Callable


def _serve(conn, source: str, dtype_name: str, threads: int) -> None:
    import torch

    from launcher.baseline import hf_model

    torch.set_num_threads(threads)
    model = hf_model(source, getattr(torch, dtype_name))
    conn.send("ready")
    while (request := conn.recv()) is not None:
        fn, args = request
        conn.send(fn(model, *args))


class BaselineProcess:
    """`run(fn, *args)` calls fn(model, *args) in the child, which holds the transformers model
    (fn must be a module-level function, so the child can import it)."""

    def __init__(self, source: str, dtype_name: str, threads: int):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child, source, dtype_name, threads),
                                    daemon=True)
        self._process.start()
        if self._conn.recv() != "ready":
            raise RuntimeError("the transformers process did not start")

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        self._conn.send((fn, args))
        return self._conn.recv()

    def close(self) -> None:
        self._conn.send(None)
        self._process.join(timeout=30)

    def __enter__(self) -> "BaselineProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
