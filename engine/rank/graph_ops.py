"""The KV store and attention as registered custom ops, for the graphs `compile=True` builds.

A compiled graph sees each as one opaque call taking and returning tensors, so torch.compile
fuses everything between the calls and a whole forward is one graph, with no break per layer.
The cache goes in as a tensor argument, marked as written, so the graph orders the op against
anything else that reads the cache.

The layers graph's op needs the step's metadata too: host lists, block tables and the backend
that runs it, none of which can be a graph input. It reaches the op through one channel,
`running(ctx)` / `current_step()`, a context variable the runner sets for the length of one
forward (as vLLM's forward context does). Nothing else in the engine carries step data outside
the `StepContext` passed to the layers.

A graph may run more rows than the step has (decode batches padded to a size bucket): the op
stores and attends the step's own rows only, and returns zeros for the padding.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Iterator

import torch

from engine.rank import fused_attention
from engine.rank.kv_cache import store_into
from parallel import graph_op

if TYPE_CHECKING:
    from engine.rank.step_context import StepContext

# one value per thread (in-process ranks share a process, each on its own thread)
_step: ContextVar[StepContext | None] = ContextVar("prefill_step", default=None)


@contextmanager
def running(ctx: StepContext) -> Iterator[None]:
    """Make `ctx` the step the graph ops read, for one forward."""
    token = _step.set(ctx)
    try:
        yield
    finally:
        _step.reset(token)


def current_step() -> StepContext:
    ctx = _step.get()
    if ctx is None:
        raise RuntimeError("a compiled graph ran outside graph_ops.running(): its KV store and "
                           "attention have no step metadata to read")
    return ctx


def _store_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                      layer: int, scale: float) -> torch.Tensor:
    """The step's new K/V of `layer` into their slots of `cache` (the rank's whole cache), then
    causal attention of its queries over their context: [rows, hq, d], by the eager step's own
    ops. One op, not two: a call to it is one more dispatch per layer."""
    ctx = current_step()
    n = ctx.meta.cu_seqlens_q[-1]
    ctx.ops.store(ctx, layer, k[:n], v[:n])
    # contiguous, as the fake says: an eager attention may return a transposed view
    out = ctx.ops.attend(ctx, layer, q[:n], k[:n], v[:n], scale).contiguous()
    if n == len(q):
        return out
    return torch.cat((out, out.new_zeros(len(q) - n, *out.shape[1:])))


store_and_attend = graph_op.define(
    "store_and_attend(Tensor q, Tensor k, Tensor v, Tensor(a!) cache, SymInt layer, "
    "float scale) -> Tensor", _store_and_attend,
    lambda q, k, v, cache, layer, scale: torch.empty_like(q))

# K/V [rows, hkv, d] into their slots of `layer` in `cache` ([k|v, layer, block, slot, hkv, d],
# the rank's whole cache). The compiled decode graph's store: written in the graph itself, the
# cache would be copied whole at every step (inductor does not write a graph input in place),
# while an op marked as writing it does.
kv_store = graph_op.define(
    "kv_store(Tensor k, Tensor v, Tensor(a!) cache, SymInt layer, Tensor slot_mapping) -> ()",
    lambda k, v, cache, layer, slot_mapping: store_into(cache, layer, k, v, slot_mapping),
    lambda k, v, cache, layer, slot_mapping: None)


# A decode step's store and attention of one layer as one call to the fused CPU kernel, for
# the compiled decode graph where it timed faster than the graph's own attention
# (engine.rank.kernel_choice); declared beside its library
fused_paged_decode = fused_attention.fused_paged_decode


class LayersGraphOps:
    """The layers graph's `ops`: one opaque op stores and attends (the store happens there)."""

    def store(self, ctx: StepContext, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        return None

    def attend(self, ctx: StepContext, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, scale: float) -> torch.Tensor:
        return store_and_attend(q, k, v, ctx.cache.data, layer, scale)


LAYERS_GRAPH_OPS = LayersGraphOps()
