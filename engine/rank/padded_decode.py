"""A decode step written for the compiled decode graph: its metadata as tensors only, its rows
padded to the graph's size, and its paged attention as plain tensor math that inductor fuses.

Every row is one sequence's newest token. Padding rows repeat the step's last row (its token,
position, slot and context), so the K/V they write into that slot are the very values the row
itself writes: the store can run inside the graph with no scratch slot and no mask. The block
table is as wide as the step's longest context (at least two blocks, so one graph with a
dynamic width covers every length); columns past a row's context are masked out.

Reading K/V through the block table inside the graph lets inductor fold the gather into the
attention's loops: no per-layer copy of the context and no opaque op call per layer. Measured
on the AVX512 EPYC, SmolLM2, 257-token context: see BENCHMARKS.md (issue 12). Where the fused
CPU kernel timed faster (engine.rank.kernel_choice), one opaque call per layer does the store
and the attention instead (`FUSED_DECODE_OPS`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.batch import Batch
from engine.rank import graph_ops
from engine.rank.kv_cache import KVCache
from engine.rank.step_context import DECODE, StepContext
from engine.rank.step_metadata import pack_to_device


@dataclass(slots=True)
class PaddedDecode:
    """The compiled decode graph's metadata (a StepContext's `meta`): tensors only."""

    slot_mapping: torch.Tensor  # [rows] slot of each row's new K/V
    block_table: torch.Tensor  # [rows, width] block ids, width >= 2
    context_lens: torch.Tensor  # [rows] positions each row attends to, its own included
    kv_head_of_q: torch.Tensor  # [hq] the local KV head each local query head reads


def padded_lists(batch: Batch, rows: int, width: int) -> dict[str, list[int]]:
    """A decode step's integers (ids, positions, slots, lens, then the block table, `width`
    columns: cut, or padded with block 0, which the attention masks), each padded to `rows` rows
    by repeating the step's last row."""
    pad = rows - batch.num_seqs
    tables = [t[:width] + [0] * (width - len(t[:width])) for t in batch.block_tables]
    lists = {"ids": batch.token_ids, "positions": batch.positions, "slots": batch.slot_mapping,
             "lens": batch.context_lens, "table": [b for t in tables for b in t]}
    return {name: values + values[-(len(values) // batch.num_seqs):] * pad
            for name, values in lists.items()}


class PaddedDecodeOps:
    """The decode graph's `ops`: the store as a custom op that writes the cache in place, the
    attention as tensor math over the block table, which inductor fuses."""

    def store(self, ctx: StepContext, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        graph_ops.kv_store(k, v, ctx.cache.data, layer, ctx.meta.slot_mapping)

    def attend(self, ctx: StepContext, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, scale: float) -> torch.Tensor:
        return padded_decode_attention(q, *ctx.cache.layer(layer), ctx.meta, scale)


class FusedDecodeOps:
    """The decode graph's `ops` on a CPU where the fused kernel won: one opaque op per layer
    stores the new K/V and attends (engine.rank.fused_attention.paged_decode)."""

    def store(self, ctx: StepContext, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        return None  # the attention's op stores them

    def attend(self, ctx: StepContext, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, scale: float) -> torch.Tensor:
        meta = ctx.meta
        return graph_ops.fused_paged_decode(q, k, v, ctx.cache.data, layer, meta.slot_mapping,
                                            meta.block_table, meta.context_lens, scale)


PADDED_DECODE_OPS, FUSED_DECODE_OPS = PaddedDecodeOps(), FusedDecodeOps()


def padded_context(ids: torch.Tensor, positions: torch.Tensor, meta: PaddedDecode,
                   cache: KVCache, decode_weights: bool, fused: bool = False) -> StepContext:
    """The StepContext of a decode graph of `len(ids)` rows; `fused`: its store and attention
    through the fused CPU kernel."""
    return StepContext(DECODE, ids, positions, None, cache, meta,
                       FUSED_DECODE_OPS if fused else PADDED_DECODE_OPS,
                       graph=f"decode-{len(ids)}", decode_weights=decode_weights)


def pad_decode_step(batch: Batch, cache: KVCache, kv_head_of_q: torch.Tensor, rows: int,
                    decode_weights: bool = False, fused: bool = False) -> StepContext:
    """A decode step's context, its rows padded to `rows`."""
    width = max(2, -(-max(batch.context_lens) // cache.block_size))
    # one host->device copy for the whole step (pinned and non-blocking on CUDA)
    t = pack_to_device(padded_lists(batch, rows, width), kv_head_of_q.device)
    meta = PaddedDecode(t["slots"], t["table"].view(rows, width), t["lens"], kv_head_of_q)
    return padded_context(t["ids"], t["positions"], meta, cache, decode_weights, fused)


def padded_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: PaddedDecode, scale: float) -> torch.Tensor:
    """q [rows, hq, d], one query per row at its sequence's last position; k/v_cache [blocks,
    block_size, hkv, d] hold every row's context (its own new K/V already stored). Returns
    [rows, hq, d]."""
    rows, width = meta.block_table.shape
    length = width * k_cache.shape[1]
    # [rows, length, hq, d]: each query head's KV head, read through the block table
    keys = k_cache[meta.block_table].view(rows, length, -1, q.shape[-1])[:, :, meta.kv_head_of_q]
    values = v_cache[meta.block_table].view(rows, length, -1, q.shape[-1])[:, :, meta.kv_head_of_q]
    scores = (q.unsqueeze(1).float() * keys.float()).sum(-1) * scale  # [rows, length, hq]
    seen = torch.arange(length, device=q.device) < meta.context_lens.unsqueeze(1)
    scores = scores.masked_fill(~seen.unsqueeze(-1), float("-inf"))
    weights = torch.softmax(scores, dim=1)
    return (weights.unsqueeze(-1) * values.float()).sum(1).to(q.dtype)
