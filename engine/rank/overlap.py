"""`overlap_comm`: a step's tokens as two micro-batches, interleaved layer by layer, so one
half's tensor-parallel all-reduce is in flight while the other half computes.

Per layer and half, the work is [norm, QKV, RoPE, KV write, attention, o_proj matmul] then an
all-reduce, then [norm, gate/up, SiLU·mul, down matmul] then an all-reduce. The schedule is

    A: attention part -> start AR      B: attention part -> start AR
    A: wait AR, MLP part -> start AR   B: wait AR, MLP part -> start AR
    (next layer) A: wait AR, ...

so each all-reduce overlaps the other half's compute. The split is along the packed tokens:
a sequence cut in two keeps its earlier positions in the first half, whose K/V are in the paged
cache (written by that half's KV store in the same layer) before the second half's attention
reads them. Each half therefore gets step metadata of its own, as a chunk of a chunked prefill
would: the first part of a cut sequence sees a shorter context, the second the whole one.
The rows, the sums and the attention context are the same as without the split, so the
results are the same up to float rounding of the half-sized matmuls.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.rank.step_context import StepContext
from engine.rank.step_metadata import build_step_metadata
from parallel.layers import RowParallelInFlight

Step = tuple[list[int], list[int], list[list[int]], list[int]]  # cu_q, ctx lens, tables, slots


def split_step(cu_seqlens_q: list[int], context_lens: list[int], block_tables: list[list[int]],
               slot_mapping: list[int], split: int) -> tuple[Step, Step]:
    """The step's metadata for rows [0, split) and for rows [split, T). A sequence cut by the
    split appears in both; its first part's context ends where its second part begins."""
    first: Step = ([0], [], [], list(slot_mapping[:split]))
    second: Step = ([0], [], [], list(slot_mapping[split:]))
    for i, kv_len in enumerate(context_lens):
        s, e = cu_seqlens_q[i], cu_seqlens_q[i + 1]
        if s < split:  # rows before the split; the context lacks the rows after it
            end = min(e, split)
            first[0].append(first[0][-1] + end - s)
            first[1].append(kv_len - (e - end))
            first[2].append(block_tables[i])
        if e > split:
            second[0].append(second[0][-1] + e - max(s, split))
            second[1].append(kv_len)
            second[2].append(block_tables[i])
    return first, second


def with_halves(ctx: StepContext, batch, kv_head_of_q: list[int], uniform_groups: bool,
                split: int | None = None) -> StepContext:
    """`ctx` (a whole step's context) with its two micro-batches, rows [0, split) and [split, T)
    (None: half and half): each half's own metadata, built once for the step like the whole
    one, and its rows of the positions."""
    split = batch.num_tokens // 2 if split is None else split
    halves = split_step(batch.cu_seqlens_q, batch.context_lens, batch.block_tables,
                        batch.slot_mapping, split)
    rows = (slice(0, split), slice(split, None))
    ctx.halves = tuple(
        StepContext(ctx.mode, ctx.token_ids[r], ctx.positions[r], None, ctx.cache,
                    build_step_metadata(cu, lens, tables, slots, kv_head_of_q, ctx.cache.data.device,
                                        uniform_groups=uniform_groups,
                                        block_size=ctx.cache.block_size), ctx.ops)
        for r, (cu, lens, tables, slots) in zip(rows, halves))
    return ctx


def run_halves_interleaved(layers: nn.ModuleList, x: torch.Tensor,
                           halves: tuple[StepContext, StepContext]) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layers over both halves of the embedded rows `x`, interleaved so that each
    half's all-reduce is in flight while the other half computes; (hidden, residual)."""
    m = len(halves[0].positions)
    ready, residuals = [x[:m], x[m:]], [None, None]
    in_flight: list[RowParallelInFlight | None] = [None, None]
    for layer in layers:
        for h in (0, 1):
            if in_flight[h] is not None:
                ready[h] = in_flight[h].wait()
            in_flight[h], residuals[h] = layer.attention_part(ready[h], residuals[h], halves[h],
                                                              async_op=True)
        for h in (0, 1):
            in_flight[h], residuals[h] = layer.mlp_part(in_flight[h].wait(), residuals[h],
                                                        async_op=True)
    return torch.cat([p.wait() for p in in_flight]), torch.cat(residuals)
