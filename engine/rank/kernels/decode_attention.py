"""Decode attention over the paged KV cache: one new query per sequence, split-K.

A decode step reads the whole context of every sequence to produce one row each: it is bound by
memory traffic, and with few sequences a grid of (sequence, KV head) would leave most of the GPU
idle. So the context is cut into splits of kv_per_split keys, each program folds one split into a
partial softmax (running max m, denominator l, unnormalised accumulator), and a second kernel merges
the splits of each (sequence, query head).

Each split program serves every query head that reads its KV head, so each K/V tile is loaded once
per group, not once per query head. The group's query rows form the M side of tl.dot, padded to 16
(the MMA minimum); the padding costs tensor-core work that a memory-bound kernel has to spare.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.rank.kernels.interpreter import needs_fp32_dot
from engine.rank.kernels.online_softmax import LOG2E, dot_precision, fold_tile
from engine.rank.kernels.paging import load_kv_tile
from engine.rank.step_metadata import StepMetadata, decode_kv_per_split
from engine.rank.kv_cache import KVCache



@triton.jit(do_not_specialize=["stride_table"])  # the table's width changes every few steps
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, ctx_ptr, table_ptr, group_ptr,
                         part_acc_ptr, part_m_ptr, part_l_ptr, qk_scale,
                         stride_qb, stride_qh,
                         stride_cblock, stride_cslot, stride_chead, stride_table, group_width,
                         stride_pb, stride_ph,
                         kv_per_split, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_len = tl.load(ctx_ptr + seq)
    start = split * kv_per_split
    end = tl.minimum(start + kv_per_split, kv_len)  # empty (start >= end) for short sequences
    table_ptr += seq.to(tl.int64) * stride_table

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM  # constant: all true unless the head dim is padded
    # -1 pads the group; the rows past its width pad the MMA's 16-row minimum
    q_head = tl.load(group_ptr + kv_head * group_width + offs_g, mask=offs_g < group_width,
                     other=-1)
    g_ok = q_head >= 0
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + q_head[:, None] * stride_qh
                + offs_d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)

    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        in_split = pos < end
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, pos, in_split, kv_head, offs_d,
                            d_ok, stride_cblock, stride_cslot, stride_chead, BLOCK_SIZE, FP32_DOT)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # log2 units
        s = tl.where(in_split[None, :], s, float("-inf"))
        # the first tile of a split always holds key `start`, so every row has a finite score
        acc, m_i, l_i = fold_tile(acc, m_i, l_i, s, v, PRECISION)

    # partials are indexed by query head, so the merge needs no knowledge of the grouping, and
    # it reads only the splits that hold keys. part_acc is [B, hq, splits, BLOCK_D] contiguous,
    # i.e. part_m's [B, hq, splits] layout times BLOCK_D
    part = seq.to(tl.int64) * stride_pb + q_head * stride_ph + split
    tl.store(part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc,
             mask=g_ok[:, None] & d_ok[None, :])
    tl.store(part_m_ptr + part, m_i, mask=g_ok)
    tl.store(part_l_ptr + part, l_i, mask=g_ok)


@triton.jit
def _decode_merge_kernel(part_acc_ptr, part_m_ptr, part_l_ptr, ctx_ptr, out_ptr,
                         stride_pb, stride_ph, stride_ob, stride_oh,
                         head_dim, kv_per_split,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    seq, head = tl.program_id(0), tl.program_id(1)
    num_splits = tl.cdiv(tl.load(ctx_ptr + seq), kv_per_split)  # those of this sequence
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < head_dim
    part = seq.to(tl.int64) * stride_pb + head * stride_ph + offs_s
    m = tl.load(part_m_ptr + part, mask=s_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    # rescale every split to the global max; splits past the context get weight exp2(-inf) = 0
    w = tl.exp2(m - tl.max(m, axis=0))
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)


def triton_decode_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cache: KVCache, step: StepMetadata, scale: float,
                            kv_per_split: int | None = None,
                            block_n: int | None = None) -> torch.Tensor:
    """Same contract as triton_attention when every sequence has exactly one new token:
    q [B, hq, d], k/v [B, hkv, d] (already in the cache). Returns [B, hq, d] in q's dtype.
    step: the step's metadata, built once per step (no host work here). kv_per_split overrides the split length: any positive count
    works; a multiple of block_n wastes no loads (the last tile of a split is masked)."""
    num_seqs, num_q_heads, head_dim = q.shape
    if step.num_seqs != num_seqs or not (step.is_decode or num_seqs == 0):
        raise ValueError(f"decode attention takes one new token per sequence; got {num_seqs} "
                         f"queries for cu_seqlens_q {step.cu_seqlens_q}: use triton_attention")
    assert q.stride(-1) == 1, "head dim must be contiguous"
    out = torch.empty((num_seqs, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    defaults = step.defaults
    if kv_per_split is None:
        kv_per_split = step.decode_kv_per_split or decode_kv_per_split(
            q.device, defaults, num_seqs, step.num_kv_heads, step.max_kv)
    if kv_per_split <= 0:
        raise ValueError(f"kv_per_split={kv_per_split}: it must be a positive key count")
    # a tile wider than a split would only load masked keys
    block_n = block_n or min(defaults.decode_block_n,
                             max(16, triton.next_power_of_2(kv_per_split)))
    num_splits = triton.cdiv(step.max_kv, kv_per_split)

    dev = q.device
    block_d = max(16, triton.next_power_of_2(head_dim))
    part_acc = torch.empty((num_seqs, num_q_heads, num_splits, block_d), dtype=torch.float32,
                           device=dev)
    part_m = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    k_cache, v_cache = cache.layer(layer)
    fp32_dot = needs_fp32_dot(q)
    precision = dot_precision(q.dtype, fp32_dot)
    _decode_split_kernel[(num_seqs, step.num_kv_heads, num_splits)](
        q, k_cache, v_cache, step.ctx, step.table, step.groups, part_acc, part_m, part_l,
        scale * LOG2E, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), step.table.stride(0),
        step.group_width, part_m.stride(0), part_m.stride(1),
        kv_per_split, BLOCK_SIZE=cache.block_size, HEAD_DIM=head_dim,
        BLOCK_G=max(16, step.group_width), BLOCK_N=block_n, BLOCK_D=block_d,
        FP32_DOT=fp32_dot, PRECISION=precision)
    _decode_merge_kernel[(num_seqs, num_q_heads)](
        part_acc, part_m, part_l, step.ctx, out,
        part_m.stride(0), part_m.stride(1), out.stride(0), out.stride(1),
        head_dim, kv_per_split,
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d)
    return out
