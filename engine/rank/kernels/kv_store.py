"""Scatter the new tokens' K and V into their slots of the paged KV cache."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.rank.kv_cache import KVCache


@triton.jit
def _kv_store_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cslot, stride_chead,
                     num_heads, head_dim,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # one program per token: its K and V rows for every KV head are one contiguous slot in the cache
    # int64 offsets: slot * slot stride passes 2**31 in a cache over 2 GiB per layer, and
    # t * token stride does in a batch of 64k tokens of a wide fused QKV projection
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < num_heads) & (offs_d < head_dim)
    dst = slot * stride_cslot + offs_h * stride_chead + offs_d
    k = tl.load(k_ptr + t * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def triton_kv_store(cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Like KVCache.store: k/v [T, kv_heads, d] go to flat slots slot_mapping [T] of `layer`.
    Every slot must be valid (the scheduler never pads)."""
    k_cache, v_cache = cache.layer(layer)  # [blocks, block_size, kv_heads, d], contiguous
    assert k.shape == v.shape and k.shape[1:] == k_cache.shape[2:], (k.shape, k_cache.shape)
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "head dim must be contiguous"
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _kv_store_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),  # slot and head strides of the flat slot view
        num_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim))


kv_store_reference = KVCache.store  # the plain-torch function this kernel replaces
