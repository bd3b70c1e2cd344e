"""`decode_dtype="bfloat16"`: decode steps read bfloat16 copies of the projection weights.

A decode step multiplies one row per sequence by every weight matrix, so its time is the time
to read the weights: half the bytes, about half the time. Prefill steps keep the float32
weights (they are compute-bound and would only lose precision). The copies are packed once, in
oneDNN's own layout for single-row products; the activations stay float32 between the
projections, and each product accumulates in float32 (parallel.gemm). Cost: a second copy of
the projections, half the size of the float32 one.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from parallel.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

_PROJECTIONS = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)


class DecodeWeights:
    """Swaps every projection's weight between the model's own and its low-precision copy."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, packed: bool = True):
        self.modules = [m for m in model.modules() if isinstance(m, _PROJECTIONS)]
        self.full = [m.weight for m in self.modules]
        # packed: for one row at a time, the layout oneDNN reads fastest in an eager decode
        # step; plain (compile=True), for a graph, which cannot take oneDNN's opaque layout and
        # streams the rows itself (parallel.gemm)
        self.low = [torch.ops.mkldnn._reorder_linear_weight(w.detach().to(dtype), 1) if packed
                    else w.detach().to(dtype) for w in self.full]
        self.nbytes = sum(w.numel() * dtype.itemsize for w in self.full)

    @contextmanager
    def active(self) -> Iterator[None]:
        """The copies in place for one step; the model's own weights outside it (so memory
        reports, tracing set-up and scoring always see those)."""
        # the registered parameter itself is swapped: a tied LM head keeps the embedding's
        # float32 rows for lookups while its products read the copy
        for module, low in zip(self.modules, self.low):
            module._parameters["weight"] = low
        try:
            yield
        finally:
            for module, full in zip(self.modules, self.full):
                module._parameters["weight"] = full
