"""The roof of the roofline: peak FLOP/s and memory bandwidth, from a spec sheet or measured."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.errors import ConfigError

from engine.rank.gemm import linear

# dense bf16 tensor-core FLOP/s and HBM bandwidth from the vendors' spec sheets
SPECS = {
    "h100": (989e12, 3.35e12),
    "h200": (989e12, 4.8e12),
    "a100": (312e12, 2.0e12),
}


def roofline_side(flops: float, nbytes: float, ridge: float) -> str:
    """"compute" where the op's arithmetic intensity reaches the ridge, else "memory"."""
    return "compute" if nbytes == 0 or flops / nbytes >= ridge else "memory"


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    peak_flops: float  # FLOP/s
    peak_bytes: float  # bytes/s

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP/byte) where an op stops being memory-bound."""
        return self.peak_flops / self.peak_bytes

    def bound(self, flops: int, nbytes: int) -> str:
        return roofline_side(flops, nbytes, self.ridge)

    def to_dict(self) -> dict:
        return {"name": self.name, "peak_flops": self.peak_flops, "peak_bytes_per_s": self.peak_bytes,
                "ridge_flops_per_byte": self.ridge}


def best_seconds(fn, repeats: int = 5) -> float:
    """Fastest of `repeats` timed runs after one untimed: the run least disturbed by the rest of
    the machine."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(device: str, dtype: torch.dtype) -> Hardware:
    """A short matmul and a large copy on this device, in the model's dtype. The matmul goes
    through the library the model's projections use (`engine.rank.gemm.linear`), so the peak is
    the one the engine can reach."""
    n = 1024 if device == "cpu" else 8192
    a = torch.randn(n, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def matmul():
        linear(a, a)
        sync()

    src, dst = copy_buffers(device)

    def copy():
        dst.copy_(src)
        sync()

    flops = 2 * n ** 3 / best_seconds(matmul)
    bandwidth = 2 * src.numel() * 4 / best_seconds(copy)  # read + write
    return Hardware(f"{device}-measured", flops, bandwidth)


def copy_buffers(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A 64 MiB source, past the caches, and a destination to copy it to. The source is written
    first: a fresh CPU allocation's pages that were never written all map to the kernel's one
    zero page, which stays in cache, so a copy from them reads almost nothing from memory (on
    the Zen 4 EPYC, 2 threads: 49.4 GB/s counted against 28.5 from a written source)."""
    src = torch.ones(64 * 2**20 // 4, device=device)
    return src, torch.empty_like(src)


def hardware(name: str, device: str, dtype: torch.dtype) -> Hardware:
    if name in SPECS:
        return Hardware(name, *SPECS[name])
    if name in (f"{device.split(':')[0]}-measured", "measured"):
        return measure(device, dtype)
    raise ConfigError(f"hardware={name!r}: use one of {sorted(SPECS)} or 'cpu-measured'/'cuda-measured'")
