"""Small helpers shared by the benchmarks."""
from __future__ import annotations

import platform

import torch

from engine.observe.hardware import best_seconds as best_of  # noqa: F401  (shared by the benchmarks)
from engine.loading.synthetic import random_token_ids as random_ids  # noqa: F401


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
