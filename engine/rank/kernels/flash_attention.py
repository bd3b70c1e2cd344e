"""Flash-attention prefill over the paged KV cache, a drop-in for engine.rank.attention.torch_attention.

Each sequence's new queries are the last q_len positions of its context; keys and values are read
from the paged cache through the block table, so a chunk after earlier chunks, a prefix-cache hit
and a decode step (q_len = 1) all take the same path.

Grid: (query tile, query head). A query tile is BLOCK_M consecutive new tokens of one sequence;
the tiles of all sequences are listed on the host, so packed sequences of any length need no
padding.
Each program walks the keys in BLOCK_N steps with an online softmax in fp32, so no score matrix
larger than [BLOCK_M, BLOCK_N] ever exists.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.rank.attention import AttentionMetadata
from engine.rank.kernels.interpreter import needs_fp32_dot
from engine.rank.kernels.online_softmax import fold_tile
from engine.rank.kernels.paging import block_table_tensor, load_kv_tile
from engine.rank.kv_cache import KVCache

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(acc, m_i, l_i, q, q_pos, qk_scale, k_cache_ptr, v_cache_ptr, table_ptr,
                 n_start, n_end, kv_len, kv_head,
                 stride_cblock, stride_cslot, stride_chead, block_size, head_dim,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 CAUSAL: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Fold keys [n_start, n_end) into the running (acc, m_i, l_i). Scores are kept in log2 units
    (qk_scale = scale * log2 e) so exp2 can be used. With CAUSAL False the caller guarantees that
    every key is visible to every query row, so no mask is applied."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    for n0 in range(n_start, n_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        in_ctx = pos < kv_len
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, pos, in_ctx, kv_head, offs_d,
                            d_ok, stride_cblock, stride_cslot, stride_chead, block_size, FP32_DOT)
        # scaled in fp32: folding the scale into a 16-bit q would round it once more
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if CAUSAL:
            visible = (pos[None, :] <= q_pos[:, None]) & in_ctx[None, :]
            s = tl.where(visible, s, float("-inf"))
        # a row's first tile always holds a key it sees (key 0, or in the band the key at
        # full_end <= its position), so every row has a finite score
        acc, m_i, l_i = fold_tile(acc, m_i, l_i, s, v, PRECISION)
    return acc, m_i, l_i


@triton.jit
def _flash_prefill_kernel(q_ptr, out_ptr, k_cache_ptr, v_cache_ptr,
                          tile_seq_ptr, tile_start_ptr, cu_q_ptr, ctx_ptr, table_ptr,
                          kv_head_of_q_ptr, qk_scale,
                          stride_qt, stride_qh, stride_ot, stride_oh,
                          stride_cblock, stride_cslot, stride_chead, stride_table,
                          block_size, head_dim,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    tile, head = tl.program_id(0), tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    m0 = tl.load(tile_start_ptr + tile)  # first new token of this tile, relative to its sequence
    q_begin = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_begin
    kv_len = tl.load(ctx_ptr + seq)
    kv_head = tl.load(kv_head_of_q_ptr + head)  # explicit map: GQA groups may be uneven on a rank
    table_ptr += seq.to(tl.int64) * stride_table

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    io_mask = row_ok[:, None] & (offs_d[None, :] < head_dim)
    rows = (q_begin + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    q_pos = kv_len - q_len + offs_m  # absolute positions; padding rows run past kv_len - 1

    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    # keys before the tile's first query are visible to all its rows: no mask needed there
    first_pos = kv_len - q_len + m0
    full_end = (first_pos // BLOCK_N) * BLOCK_N
    acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, qk_scale,
                                 k_cache_ptr, v_cache_ptr, table_ptr, 0, full_end, kv_len, kv_head,
                                 stride_cblock, stride_cslot, stride_chead, block_size, head_dim,
                                 BLOCK_N, BLOCK_D, False, FP32_DOT, PRECISION)
    # the diagonal band: keys up to the tile's last real query, masked causally
    last_pos = kv_len - q_len + tl.minimum(m0 + BLOCK_M, q_len) - 1
    acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, qk_scale,
                                 k_cache_ptr, v_cache_ptr, table_ptr, full_end, last_pos + 1,
                                 kv_len, kv_head,
                                 stride_cblock, stride_cslot, stride_chead, block_size, head_dim,
                                 BLOCK_N, BLOCK_D, True, FP32_DOT, PRECISION)

    out = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


def _default_blocks(q: torch.Tensor, head_dim: int) -> tuple[int, int]:
    if q.device.type == "cpu":  # interpreter: small tiles, so tiny test shapes still span several
        return 16, 16
    return (64, 64) if head_dim <= 128 else (64, 32)  # stay within shared memory for wide heads


def triton_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cache: KVCache, meta: AttentionMetadata, scale: float,
                     block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """q: [T, hq, d] for the new tokens, whose K/V (k/v: [T, hkv, d]) are already in the cache.
    Returns the causal attention of the new tokens over their whole context, [T, hq, d] in q's
    dtype."""
    num_tokens, num_q_heads, head_dim = q.shape
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    default_m, default_n = _default_blocks(q, head_dim)
    block_m, block_n = block_m or default_m, block_n or default_n
    assert q.stride(-1) == 1, "head dim must be contiguous"

    cu = meta.cu_seqlens_q
    tiles = [(i, m0) for i in range(len(cu) - 1) for m0 in range(0, cu[i + 1] - cu[i], block_m)]
    if not tiles:
        return out
    dev = q.device
    tile_seq = torch.tensor([t[0] for t in tiles], dtype=torch.int32, device=dev)
    tile_start = torch.tensor([t[1] for t in tiles], dtype=torch.int32, device=dev)
    cu_q = torch.tensor(cu, dtype=torch.int32, device=dev)
    ctx = torch.tensor(meta.context_lens, dtype=torch.int32, device=dev)
    table = block_table_tensor(meta.block_tables, dev)
    k_cache, v_cache = cache.layer(layer)
    fp32_dot = needs_fp32_dot(q)
    # fp32 inputs get full-precision dots (tf32 would cost ~1e-3 relative error); 16-bit ones
    # ignore the setting
    precision = "ieee" if q.dtype == torch.float32 or fp32_dot else "tf32"
    _flash_prefill_kernel[(len(tiles), num_q_heads)](
        q, out, k_cache, v_cache, tile_seq, tile_start, cu_q, ctx, table,
        meta.kv_head_of_q, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), table.stride(0),
        cache.block_size, head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        FP32_DOT=fp32_dot, PRECISION=precision)
    return out


def paged_attention_reference(layer: int, q: torch.Tensor, cache: KVCache,
                              meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Plain-torch causal attention of the new queries over the paged cache (K/V already stored):
    explicit gather through the block table, fp32 scores and softmax."""
    k_cache, v_cache = cache.layer(layer)
    bs = cache.block_size
    out = torch.empty_like(q)
    cu = meta.cu_seqlens_q
    for i, kv_len in enumerate(meta.context_lens):
        s, e = cu[i], cu[i + 1]
        pos = torch.arange(kv_len, device=q.device)
        blocks = torch.tensor(meta.block_tables[i], device=q.device)[pos // bs]
        keys = k_cache[blocks, pos % bs].float()[:, meta.kv_head_of_q]  # [kv_len, hq, d]
        values = v_cache[blocks, pos % bs].float()[:, meta.kv_head_of_q]
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), keys) * scale
        q_pos = torch.arange(kv_len - (e - s), kv_len, device=q.device)
        scores.masked_fill_(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
    return out
