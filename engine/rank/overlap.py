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

from dataclasses import dataclass

import torch

from engine.rank.attention import StepContext
from engine.rank.kernels.step_metadata import build_step_metadata
from parallel.layers import RowParallelInFlight

Step = tuple[list[int], list[int], list[list[int]], list[int]]  # cu_q, ctx lens, tables, slots


@dataclass(slots=True)
class SplitContext:
    """A step run as two micro-batches: rows [0, split) and [split, T)."""

    split: int
    halves: tuple[StepContext, StepContext]


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


def make_split_context(batch, cache, kv_head_of_q: list[int], device: torch.device,
                       uniform_groups: bool) -> SplitContext:
    """Both halves' metadata, each built once for the step like the unsplit one."""
    split = batch.num_tokens // 2
    halves = split_step(batch.cu_seqlens_q, batch.context_lens, batch.block_tables,
                        batch.slot_mapping, split)
    contexts = tuple(StepContext(cache, build_step_metadata(cu, lens, tables, slots, kv_head_of_q,
                                                            device, uniform_groups=uniform_groups))
                     for cu, lens, tables, slots in halves)
    return SplitContext(split, contexts)


def run_layers_split(model, token_ids: torch.Tensor, positions: torch.Tensor,
                     ctx: SplitContext) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layers over both halves, interleaved; (hidden, residual) for all rows."""
    m = ctx.split
    x = model.embed_tokens(token_ids)  # one all-reduce for the whole step, not overlapped
    xs, residuals = [x[:m], x[m:]], [None, None]
    pos = (positions[:m], positions[m:])
    in_flight: list[RowParallelInFlight | None] = [None, None]
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for h in (0, 1):
            if in_flight[h] is not None:
                xs[h] = in_flight[h].wait()
            xs[h], residuals[h] = layer.input_layernorm(xs[h], residuals[h])
            in_flight[h] = attn.o_proj.start(attn.attend(pos[h], xs[h], ctx.halves[h]))
        for h in (0, 1):
            xs[h], residuals[h] = layer.post_attention_layernorm(in_flight[h].wait(), residuals[h])
            in_flight[h] = mlp.down_proj.start(mlp.act_fn(mlp.gate_up_proj(xs[h])))
    xs = [p.wait() for p in in_flight]
    return torch.cat(xs), torch.cat(residuals)
