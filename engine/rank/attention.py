"""Attention of new tokens over their sequence's cached prefix plus themselves.

One function covers a whole prompt, a chunk of one after earlier chunks or a prefix-cache hit,
and a decode step: each sequence's queries are the last q_len positions of its context. The
modules here (`KVStore`, `PagedAttention`) are the two ops every layer runs on the cache; which
implementation runs them is the step's choice (`StepContext.ops`), made once per step.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.rank import gemm
from engine.rank.blocked_attention import blocked_causal_attention
from engine.rank.kv_cache import KVCache
from engine.rank.step_context import StepContext
from engine.rank.step_metadata import StepMetadata

# (q_len, dtype) -> the kernel for a prompt of q_len > 1 tokens, or None for SDPA
PromptKernel = Callable[[int, torch.dtype], Callable | None]
# (kv_len, dtype) -> the kernel for one query over kv_len keys (a decode step), or None for SDPA
DecodeKernel = Callable[[int, torch.dtype], Callable | None]


class KVStore(nn.Module):
    """Writes the new tokens' K and V into their slots of this layer's cache."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx

    def forward(self, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> None:
        ctx.ops.store(ctx, self.layer_idx, k, v)


class PagedAttention(nn.Module):
    """Causal attention of the new queries over the whole context held in the cache."""

    def __init__(self, layer_idx: int, scale: float):
        super().__init__()
        self.layer_idx, self.scale = layer_idx, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: StepContext) -> torch.Tensor:
        return ctx.ops.attend(ctx, self.layer_idx, q, k, v, self.scale)


def _causal_mask(q_len: int, kv_len: int, device) -> torch.Tensor:
    """Query j sits at absolute position kv_len - q_len + j and sees keys up to it."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device).unsqueeze(1)
    return torch.arange(kv_len, device=device).unsqueeze(0) <= q_pos


def sdpa_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
          shared_kv: bool) -> torch.Tensor:
    """torch's SDPA of one sequence's queries [q_len, hq, d], the last q_len positions of keys/
    values [kv_len, h, d] (h = hkv with shared_kv, else hq)."""
    q_len, kv_len = len(q), len(keys)
    # [1, heads, len, d]: torch's fused CPU kernels take 4-D inputs only (3-D falls back to
    # the math path, which builds the full score matrix: ~5x slower at 2k tokens)
    queries, keys, values = (x.transpose(0, 1).unsqueeze(0) for x in (q, keys, values))
    whole = q_len == kv_len  # plain causal; a single query sees everything: no mask either
    mask = None if whole or q_len == 1 else _causal_mask(q_len, kv_len, q.device)
    o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, is_causal=whole,
                                       scale=scale, enable_gqa=shared_kv)
    return o[0].transpose(0, 1)


def fixed_prompt_kernel(q_len: int, dtype: torch.dtype) -> Callable | None:
    """The prompt attention when none was measured (engine.rank.kernel_choice): blocked bf16
    matmuls for a bf16 prompt (2.5x torch's CPU flash kernel on an AVX512-BF16 EPYC) where
    oneDNN multiplies bf16 (30x slower than SDPA at 2048 tokens on an AVX2-only EPYC, whose
    bf16 matmuls take torch's slow path); None: SDPA."""
    return (blocked_causal_attention if dtype == torch.bfloat16 and gemm.HAVE_ONEDNN_BF16
            else None)


def float32_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """One query [1, hq, d] over all of keys/values [kv_len, h, d] (h divides hq), computed on
    float32 copies: torch's CPU flash kernel takes a slow path for one bf16 query on a CPU
    without bf16 instructions (1.3x this at 256 keys and 3.4x at 8192 on an AVX2-only EPYC,
    as engine.rank.kernel_choice timed both there); a float32 model's K/V are used as they
    are. Each KV head's group of query heads is one batched product, so K/V are read once
    per group."""
    heads, group = keys.shape[1], q.shape[1] // keys.shape[1]
    queries = q[0].float().view(heads, group, -1)  # [h, group, d]
    scores = torch.bmm(queries, keys.float().permute(1, 2, 0)).mul_(scale)  # [h, group, kv_len]
    out = torch.bmm(scores.softmax(-1), values.float().transpose(0, 1))  # [h, group, d]
    return out.view(1, q.shape[1], -1).to(q.dtype)


def torch_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cache: KVCache, meta: StepMetadata, scale: float,
                    prompt_kernel: PromptKernel = fixed_prompt_kernel,
                    decode_kernel: DecodeKernel | None = None) -> torch.Tensor:
    """q: [T, hq, d], k/v: [T, hkv, d] for the new tokens, already stored in the cache.
    Returns [T, hq, d] (not always contiguous). On a CPU a prompt of more than one token runs
    `prompt_kernel`'s pick, a decode step's one query `decode_kernel`'s (None: SDPA)."""
    def one(i: int) -> torch.Tensor:
        return _sequence_attention(layer, i, q, k, v, cache, meta, scale, prompt_kernel,
                                   decode_kernel)

    if len(meta.context_lens) == 1:  # its result is the output: no copy into a buffer
        return one(0)
    out = torch.empty_like(q)
    bounds = meta.cu_seqlens_q
    for i in range(len(meta.context_lens)):
        out[bounds[i]:bounds[i + 1]] = one(i)
    return out


def _sequence_attention(layer: int, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cache: KVCache, meta: StepMetadata, scale: float,
                        prompt_kernel: PromptKernel,
                        decode_kernel: DecodeKernel | None) -> torch.Tensor:
    """Sequence i's queries over its context: [q_len, hq, d]."""
    s, e = meta.cu_seqlens_q[i], meta.cu_seqlens_q[i + 1]
    kv_len = meta.context_lens[i]
    if e - s == kv_len:  # nothing cached before: the new K/V are the whole context
        keys, values = k[s:e], v[s:e]
    else:
        keys, values = cache.gather(layer, meta.table[i], kv_len,
                                    meta.first_blocks[i] if meta.first_blocks else None)
    if not meta.uniform_groups:  # uneven groups on this rank: one KV copy per query head
        keys = keys.index_select(1, meta.kv_head_of_q)
        values = values.index_select(1, meta.kv_head_of_q)
    kernel = None
    if q.device.type == "cpu" and e - s > 1:
        kernel = prompt_kernel(e - s, q.dtype)
    elif q.device.type == "cpu" and decode_kernel is not None:
        kernel = decode_kernel(kv_len, q.dtype)
    if kernel is not None:
        return kernel(q[s:e], keys, values, scale)
    return sdpa_attention(q[s:e], keys, values, scale, meta.uniform_groups)
