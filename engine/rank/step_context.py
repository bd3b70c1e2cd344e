"""`StepContext`: everything the layers of one step read, built once per step on each rank.

It holds the step's inputs on the device (token ids, positions, the rows that sample), this
rank's KV cache, the attention backend's own precomputed metadata (`meta`), and `ops`: the KV
store and the attention this step runs with. `Worker.prepare` builds it and is the one place
that asks what kind of step this is; the layers only call `ctx.ops.store` and `ctx.ops.attend`.

The kinds of `ops` and the `meta` each reads:
- `BackendOps` (here): an eager step on the torch or Triton backend over a `StepMetadata`, or,
  with context parallelism, the ring/LSE-merge functions over a `CPMetadata`;
- `graph_ops.LayersGraphOps`: the compiled layers graph, whose one opaque op stores and attends;
- `padded_decode.PaddedDecodeOps`: the compiled decode graph, over a `PaddedDecode`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from engine.batch import Batch
from engine.rank.kv_cache import KVCache

PREFILL, MIXED, DECODE = "prefill", "mixed", "decode"


class CacheOps(Protocol):
    def store(self, ctx: StepContext, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new tokens' K/V [T, local kv heads, d] into their slots of `layer`."""

    def attend(self, ctx: StepContext, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of q [T, local q heads, d] over each sequence's whole context."""


@dataclass(slots=True)
class StepContext:
    mode: str  # PREFILL (only prompt tokens), MIXED, or DECODE (one new token per sequence)
    token_ids: torch.Tensor  # [rows] on the device (a decode graph's rows include padding)
    positions: torch.Tensor  # [rows]
    logits_indices: torch.Tensor | None  # rows that sample a token (None: a decode graph's
    #                                      first num_seqs rows, every sequence)
    cache: KVCache
    meta: Any  # the backend's own metadata: StepMetadata, PaddedDecode or CPMetadata
    ops: CacheOps
    # overlap_comm: the step as two micro-batches, each with a context of its own
    halves: tuple[StepContext, StepContext] | None = None
    graph: str = ""  # the compiled graph that runs it ("layers", "decode-4"); "" eager
    decode_weights: bool = False  # the projections read their decode_dtype copies
    # the rows the last layer's MLP runs (a prompt step's sampled rows: nothing reads the other
    # rows' output, and their K/V are stored before it); None: every row
    last_layer_rows: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class BackendOps:
    """An eager step: a backend's KV store and attention, reading the step's metadata."""

    kv_store: Callable  # (cache, layer, k, v, slot_mapping)
    attention: Callable  # (layer, q, k, v, cache, meta, scale) -> out

    def store(self, ctx: StepContext, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        first_slot = getattr(ctx.meta, "first_slot", None)  # (a StepMetadata's; not CP's)
        if first_slot is not None:
            ctx.cache.store_run(layer, k, v, first_slot)
        else:
            self.kv_store(ctx.cache, layer, k, v, ctx.meta.slot_mapping)

    def attend(self, ctx: StepContext, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, scale: float) -> torch.Tensor:
        return self.attention(layer, q, k, v, ctx.cache, ctx.meta, scale)


def step_mode(batch: Batch) -> str:
    """DECODE: every sequence brings one new token and nothing is scored; PREFILL: every
    sequence brings several (a prompt or a chunk of one); MIXED otherwise."""
    if batch.num_tokens == batch.num_seqs and not batch.score_indices:
        return DECODE
    if all(e - s > 1 for s, e in zip(batch.cu_seqlens_q, batch.cu_seqlens_q[1:])):
        return PREFILL
    return MIXED
