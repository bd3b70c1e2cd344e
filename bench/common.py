"""Small helpers shared by the benchmarks."""
from __future__ import annotations

import os
import platform

import torch

from engine.observe.hardware import best_seconds as best_of  # noqa: F401  (shared by the benchmarks)
from engine.loading.synthetic import random_token_ids as random_ids  # noqa: F401


def _cpu() -> str:
    """The CPU's model name and the flags that decide bf16 speed (AMX, AVX512-BF16, or none)."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), platform.machine())
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines()
                      if line.startswith("flags")), []))
    bf16 = [f for f in ("amx_bf16", "avx512_bf16") if f in flags] or ["no bf16 matmul units"]
    return f"{name} ({', '.join(bf16)}, {os.cpu_count()} cores)"


def machine() -> str:
    return f"{_cpu()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    """A plain text table: the title, then the header and rows right-aligned in columns."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    print(f"\n{title}\n{line}\n" + "  ".join(h.rjust(w) for h, w in zip(header, widths)))
    print(line)
    for r in rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))
    print(line, flush=True)
