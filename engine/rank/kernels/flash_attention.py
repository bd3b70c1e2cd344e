"""Flash-attention prefill over the paged KV cache, a drop-in for engine.rank.attention.torch_attention.

Each sequence's new queries are the last q_len positions of its context; keys and values are read
from the paged cache through the block table, so a chunk after earlier chunks, a prefix-cache hit
and a decode step (q_len = 1) all take the same path.

Grid: (query tile, KV head). A program serves every query head that reads its KV head: its
BLOCK_M rows are BLOCK_M / GROUP new tokens x the GROUP query heads of the group (padded to a
power of two), so each K/V tile is loaded once per KV head, not once per query head. It walks the
keys in BLOCK_N steps with an online softmax in fp32, so no score matrix larger than
[BLOCK_M, BLOCK_N] ever exists.

Tiles are found on the device: sequence j (in the step's longest-context-first order) owns the
tile slots from cu_sorted[j] // (BLOCK_M / GROUP) + j on, at least as many as it has tiles, so
the grid is T // tokens-per-tile + B programs whatever BLOCK_M the autotuner picks, and no tile
list is built on the host. Within a sequence the last (longest-context) tile runs first, so the
heaviest programs start first and the short ones fill in behind them.

Keys before a tile's first query are visible to all its rows and lie inside the context: those
tiles run with no mask at all. Only the diagonal band, which holds the context's last key, is
masked. On CUDA the launch is autotuned over config.PREFILL_TUNE_SPACE; under the interpreter
(and when the caller fixes the tile sizes) it runs one configuration.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.rank.kernels.launch_config import (GPU_DEFAULTS, PREFILL_TUNE_SPACE, KernelDefaults,
                                        tune_bucket)
from engine.rank.kernels.interpreter import needs_fp32_dot
from engine.rank.kernels.online_softmax import LOG2E, dot_precision, fold_tile
from engine.rank.kernels.paging import load_kv_tile
from engine.rank.step_metadata import StepMetadata
from engine.rank.kv_cache import KVCache



@triton.jit
def _attend_tile(acc, m_i, l_i, q, q_pos, qk_scale, k_cache_ptr, v_cache_ptr, table_ptr,
                 n_start, n_end, kv_len, kv_head,
                 stride_cblock, stride_cslot, stride_chead, BLOCK_SIZE: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 CAUSAL: tl.constexpr, MASKED: tl.constexpr, FP32_DOT: tl.constexpr,
                 PRECISION: tl.constexpr):
    """Fold keys [n_start, n_end) into the running (acc, m_i, l_i). Scores are kept in log2 units
    (qk_scale = scale * log2 e) so exp2 can be used. With CAUSAL False the caller guarantees that
    every key is visible to every query row, so no score mask is applied, and with MASKED False
    that every key is inside the context and the head dim is unpadded, so no load mask either."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for n0 in range(n_start, n_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        in_ctx = pos < kv_len
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, pos, in_ctx, kv_head, offs_d,
                            d_ok, stride_cblock, stride_cslot, stride_chead, BLOCK_SIZE, FP32_DOT,
                            MASKED)
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
def _find_tile(cu_sorted_ptr, num_seqs, tile, TOKENS: tl.constexpr):
    """(j, i): the sequence j, in heaviest-first order, whose slots hold `tile` (the largest j
    with cu_sorted[j] // TOKENS + j <= tile, by binary search), and the slot's index i in it."""
    lo = tile * 0
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        owns = tl.load(cu_sorted_ptr + mid) // TOKENS + mid <= tile
        lo = tl.where(owns, mid, lo)
        hi = tl.where(owns, hi, mid)
    return lo, tile - (tl.load(cu_sorted_ptr + lo) // TOKENS + lo)


# Integers that change from step to step are not specialised on (Triton would compile a new
# variant the first time one is 1, or stops being a multiple of 16, inside a request); tune_tokens
# is read only by the autotuner, as its key.
@triton.jit(do_not_specialize=["num_seqs", "stride_table", "tune_tokens"])
def _flash_prefill_kernel(q_ptr, out_ptr, k_cache_ptr, v_cache_ptr,
                          cu_q_ptr, ctx_ptr, order_ptr, cu_sorted_ptr, table_ptr, group_ptr,
                          num_seqs, tune_tokens, qk_scale,
                          stride_qt, stride_qh, stride_ot, stride_oh,
                          stride_cblock, stride_cslot, stride_chead, stride_table,
                          BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          MASK_FULL_TILES: tl.constexpr, FP32_DOT: tl.constexpr,
                          PRECISION: tl.constexpr):
    kv_head = tl.program_id(1)
    j, slot = _find_tile(cu_sorted_ptr, num_seqs, tl.program_id(0), BLOCK_M // GROUP)
    seq = tl.load(order_ptr + j)
    q_begin = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_begin
    kv_len = tl.load(ctx_ptr + seq)
    table_ptr += seq.to(tl.int64) * stride_table
    n_tiles = tl.cdiv(q_len, BLOCK_M // GROUP)
    active = slot < n_tiles  # a sequence owns a slot or so more than it has tiles
    # the sequence's last tile (the longest context) first; an idle slot gets an empty tile
    m0 = tl.where(active, (n_tiles - 1 - slot) * (BLOCK_M // GROUP), q_len)

    # packed rows: row r is token m0 + r // GROUP, query head groups[kv_head, r % GROUP]
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    token = m0 + offs_r // GROUP
    q_head = tl.load(group_ptr + kv_head * GROUP + offs_r % GROUP)  # -1 pads the group
    row_ok = (token < q_len) & (q_head >= 0)
    io_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows = (q_begin + token).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    q_pos = kv_len - q_len + token  # absolute positions; padding rows run past kv_len - 1

    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    # keys before the tile's first query are visible to all its rows: no mask needed there
    full_end = tl.where(active, ((kv_len - q_len + m0) // BLOCK_N) * BLOCK_N, 0)
    acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, qk_scale,
                                 k_cache_ptr, v_cache_ptr, table_ptr, 0, full_end, kv_len, kv_head,
                                 stride_cblock, stride_cslot, stride_chead, BLOCK_SIZE, HEAD_DIM,
                                 BLOCK_N, BLOCK_D, False, MASK_FULL_TILES, FP32_DOT, PRECISION)
    # the diagonal band: keys up to the tile's last real query, masked causally; it holds the
    # context's last key, so it is the only place the context-length mask is needed
    band_end = tl.where(active, kv_len - q_len + tl.minimum(m0 + BLOCK_M // GROUP, q_len), 0)
    acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, qk_scale,
                                 k_cache_ptr, v_cache_ptr, table_ptr, full_end, band_end,
                                 kv_len, kv_head,
                                 stride_cblock, stride_cslot, stride_chead, BLOCK_SIZE, HEAD_DIM,
                                 BLOCK_N, BLOCK_D, True, True, FP32_DOT, PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # 0 only in rows that are not stored
    tl.store(out_ptr + rows[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


def _keep_configs_that_fit(configs, named_args, **kwargs):
    """A tile must hold at least one token of every query head of a group. Triton passes the
    positional arguments as named_args and the keyword ones (GROUP among them) as kwargs."""
    group = kwargs.get("GROUP", named_args.get("GROUP", 1))
    return [c for c in configs if c.kwargs["BLOCK_M"] >= group] or configs[:1]


def prefill_autotuner(tiles: list[tuple[int, int, int, int]]):
    """The prefill kernel behind triton.autotune over (block_m, block_n, warps, stages) tiles,
    tuned once per (token bucket, head dim, group width, page size, dtypes): the warm-up tunes
    every bucket the engine's steps fall in (config.tuning_steps)."""
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
               for m, n, w, s in tiles]
    return triton.autotune(configs, key=["tune_tokens", "HEAD_DIM", "GROUP", "BLOCK_SIZE"],
                           prune_configs_by={"early_config_prune": _keep_configs_that_fit}
                           )(_flash_prefill_kernel)


# one config, the GPU's default, under the interpreter (no search: it would need a GPU to time)
# and with PREFILL_AUTOTUNE=0 (the GPU check's kernel tests: a search compiles 12 tiles per shape)
_flash_prefill_tuned = prefill_autotuner(
    PREFILL_TUNE_SPACE[:1] if os.environ.get("TRITON_INTERPRET") == "1"
    or os.environ.get("PREFILL_AUTOTUNE") == "0" else PREFILL_TUNE_SPACE)
_TUNE_CONFIGS = _flash_prefill_tuned.configs


def triton_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cache: KVCache, step: StepMetadata, scale: float,
                     block_m: int | None = None, block_n: int | None = None,
                     autotune: bool | None = None,
                     defaults: KernelDefaults | None = None) -> torch.Tensor:
    """q: [T, hq, d] for the new tokens, whose K/V (k/v: [T, hkv, d]) are already in the cache.
    step: the step's metadata, built once per step (no host work here). Returns the causal attention of the new tokens over their whole
    context, [T, hq, d] in q's dtype. Tile sizes: block_m/block_n if given, else autotuned on
    CUDA (autotune=None) or `defaults` (the step's, i.e. the device's, when None)."""
    num_tokens, num_q_heads, head_dim = q.shape
    assert q.stride(-1) == 1, "head dim must be contiguous"
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or step.num_seqs == 0:
        return out
    defaults = defaults or step.defaults
    group = step.group_width
    block_d = max(16, triton.next_power_of_2(head_dim))
    k_cache, v_cache = cache.layer(layer)
    fp32_dot = needs_fp32_dot(q)
    precision = dot_precision(q.dtype, fp32_dot)
    args = (q, out, k_cache, v_cache, step.cu_q, step.ctx, step.order, step.cu_sorted, step.table,
            step.groups, step.num_seqs, tune_bucket(num_tokens), scale * LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), step.table.stride(0))
    consts = dict(BLOCK_SIZE=cache.block_size, HEAD_DIM=head_dim, GROUP=group, BLOCK_D=block_d,
                  MASK_FULL_TILES=block_d != head_dim, FP32_DOT=fp32_dot, PRECISION=precision)

    def grid(c):  # tile slots: T // tokens per tile + one per sequence (see the module doc)
        return (num_tokens // (c["BLOCK_M"] // group) + step.num_seqs, step.num_kv_heads)

    tune = (q.device.type == "cuda") if autotune is None else autotune
    if tune and block_m is None and block_n is None and group <= GPU_DEFAULTS.prefill_block_m:
        _flash_prefill_tuned[grid](*args, **consts)
        return out
    wide = head_dim > 128
    block_m = max(block_m or defaults.prefill_block_m, group, 16)
    block_n = block_n or (defaults.prefill_block_n_wide if wide else defaults.prefill_block_n)
    _flash_prefill_kernel[grid({"BLOCK_M": block_m})](
        *args, **consts, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=defaults.prefill_num_warps, num_stages=defaults.prefill_num_stages)
    return out


def paged_attention_reference(layer: int, q: torch.Tensor, cache: KVCache,
                              meta: StepMetadata, scale: float) -> torch.Tensor:
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
