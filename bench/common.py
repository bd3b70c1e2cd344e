"""Small helpers shared by the benchmarks."""
from __future__ import annotations

import platform
import time

import torch


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def best_of(fn, repeats: int) -> float:
    """Fastest of `repeats` runs, in seconds: the least disturbed by the rest of the machine."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
