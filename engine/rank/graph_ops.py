"""The KV store and attention as one registered custom op, for the graphs `compile=True` builds.

A compiled graph sees it as one opaque call taking and returning tensors, so torch.compile
fuses everything between its calls and a whole forward is one graph, with no break per layer. What
it needs besides tensors (the step's metadata: host lists, block tables, the backend that runs
it) cannot travel through a graph, so the rank publishes it here while its forward runs
(`running`), the way vLLM's forward context does. The cache goes in as a tensor argument too,
marked as written, so the graph orders the op against anything else that reads the cache.

A graph may run more rows than the step has (decode batches padded to a size bucket): the op
stores and attends the step's own rows only, and returns zeros for the padding.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import torch

from engine.rank.kv_cache import store_into

if TYPE_CHECKING:
    from engine.rank.attention import StepContext

_local = threading.local()  # one step at a time per thread; in-process ranks share a process


@contextmanager
def running(ctx: StepContext, backend) -> Iterator[None]:
    """Make `ctx` (and the backend its ops run on) the one the graph ops read, for one forward."""
    _local.step = (ctx, backend)
    try:
        yield
    finally:
        _local.step = None


def _current() -> tuple[StepContext, object]:
    step = getattr(_local, "step", None)
    if step is None:
        raise RuntimeError("a compiled graph ran outside graph_ops.running(): its KV store and "
                           "attention have no step metadata to read")
    return step


@torch.library.custom_op("prefill::store_and_attend", mutates_args=("cache",))
def store_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                     layer: int, scale: float) -> torch.Tensor:
    """The step's new K/V of `layer` into their slots of `cache` (the rank's whole cache), then
    causal attention of its queries over their context: [rows, hq, d]. One op, not two: each
    custom-op call costs ~30 us of dispatch, 30 layers a decode step."""
    ctx, backend = _current()
    n = ctx.meta.cu_seqlens_q[-1]
    backend.kv_store(ctx.cache, layer, k[:n], v[:n], ctx.meta.slot_mapping)
    out = backend.attention(layer, q[:n], k[:n], v[:n], ctx.cache, ctx.meta, scale)
    if n == len(q):
        return out
    return torch.cat((out, out.new_zeros(len(q) - n, *out.shape[1:])))


@store_and_attend.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, layer: int,
      scale: float) -> torch.Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("prefill::kv_store", mutates_args=("cache",))
def kv_store(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, layer: int,
             slot_mapping: torch.Tensor) -> None:
    """K/V [rows, hkv, d] into their slots of `layer` in `cache` ([k|v, layer, block, slot,
    hkv, d], the rank's whole cache). The compiled decode graph's store: written in the graph
    itself, the cache would be copied whole at every step (inductor does not write a graph
    input in place), while a custom op marked as writing it does."""
    store_into(cache, layer, k, v, slot_mapping)
