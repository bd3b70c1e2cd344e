"""Reading K/V through the block table: the paged-cache lookup both attention kernels share.
(The block tables themselves reach the device in engine.rank.step_metadata.)"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, pos, valid, kv_head, offs_d, d_ok,
                 stride_cblock, stride_cslot, stride_chead, block_size, FP32_DOT: tl.constexpr,
                 MASKED: tl.constexpr = True):
    """K and V rows [len(pos), BLOCK_D] of one KV head at context positions `pos` (masked by
    `valid` when MASKED; the caller may drop the mask for tiles wholly inside the context, where
    the head dim is not padded either). Each key finds its own page, so a tile need not match
    the cache's block size. Offsets are int64: block * block stride passes 2**31 in a cache of
    a few GiB."""
    if MASKED:
        block = tl.load(table_ptr + pos // block_size, mask=valid, other=0).to(tl.int64)
    else:
        block = tl.load(table_ptr + pos // block_size).to(tl.int64)
    row = (block * stride_cblock + (pos % block_size).to(tl.int64) * stride_cslot
           + kv_head.to(tl.int64) * stride_chead)
    if MASKED:
        kv_mask = valid[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :])
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :])
    if FP32_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v
