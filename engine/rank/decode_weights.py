"""`decode_dtype="bfloat16"`: decode steps read bfloat16 copies of the projection weights.

A decode step multiplies one row per sequence by every weight matrix, so its time is the time
to read the weights: half the bytes, about half the time. Prefill steps keep the float32
weights (they are compute-bound and would only lose precision). The copies are packed once, in
oneDNN's own layout for single-row products; the activations stay float32 between the
projections, and each product accumulates in float32 (engine.rank.gemm). Cost: a second copy of
the projections, half the size of the float32 one.

A bfloat16 model gets such copies too, in its own dtype, for the weights whose one-row product
was measured faster packed than plain on this CPU (engine.rank.kernel_choice): the packed layout
is what oneDNN reads fastest for one row, and slower for a long prompt's rows, so prompts keep
the plain weights.

The copies live in a second view of the model, built once: the same modules' structure sharing
every tensor of the model except the projections' weights. The runner picks the view per step
(`StepContext.decode_weights`); nothing is swapped while a step runs.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from engine.rank.gemm import pack_for_rows
from parallel.comm import TensorGroup
from parallel.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

_PROJECTIONS = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)


def decode_view(model: nn.Module, tp: TensorGroup, dtype: torch.dtype, packed: bool = True,
                shapes: set[tuple[int, int]] | None = None) -> tuple[nn.Module, int]:
    """(a view of `model` whose projections read `dtype` copies of their weights, the copies'
    bytes). packed: in the layout oneDNN reads fastest for one row at a time (an eager decode
    step); plain (compile=True) for a graph, which cannot take oneDNN's opaque layout and
    streams the rows itself (engine.rank.gemm). shapes: copy only the weights of these shapes
    (the ones measured faster packed: engine.rank.kernel_choice), the others are shared.
    The view shares the model's tensor group `tp`."""
    shared = {id(t): t for t in [*model.parameters(), *model.buffers(), tp]}
    view = copy.deepcopy(model, memo=shared)
    nbytes = 0
    for module in view.modules():
        if (isinstance(module, _PROJECTIONS) and isinstance(module.weight, torch.Tensor)
                and (shapes is None or tuple(module.weight.shape) in shapes)):
            full = module.weight.detach()
            low = full.to(dtype)
            nbytes += low.numel() * low.element_size()
            # the registered parameter itself is replaced: a tied LM head keeps the embedding's
            # float32 rows for lookups while its products read the copy
            module._parameters["weight"] = pack_for_rows(low, 1) if packed else low
    return view, nbytes
