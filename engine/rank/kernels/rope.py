"""Rotary position embedding of q and k in the rotate-half layout (engine/rope.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.rank.ops import rope as rope_reference  # noqa: F401  (the plain-torch function this kernel replaces)


@triton.jit
def _rotate_heads(x_ptr, out_ptr, token, stride_xt, stride_xh, stride_ot, stride_oh,
                  num_heads, cos, sin, half,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate every head of one token: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), in fp32."""
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (offs_h < num_heads) & (offs_d < half)
    src = x_ptr + token * stride_xt + offs_h * stride_xh + offs_d
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + half, mask=mask, other=0.0)
    y1 = x1.to(tl.float32) * cos - x2.to(tl.float32) * sin
    y2 = x2.to(tl.float32) * cos + x1.to(tl.float32) * sin
    # both halves are loaded before either is stored, so out may alias x (in place)
    dst = out_ptr + token * stride_ot + offs_h * stride_oh + offs_d
    tl.store(dst, y1.to(x1.dtype), mask=mask)
    tl.store(dst + half, y2.to(x1.dtype), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh,
                 stride_qot, stride_qoh, stride_kot, stride_koh, stride_table,
                 num_q_heads, num_k_heads, half,
                 BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # one program per token: its cos/sin row is loaded once and shared by all q and k heads
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + pos * stride_table + offs, mask=offs < half, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_table + offs, mask=offs < half, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, stride_qot, stride_qoh,
                  num_q_heads, cos, sin, half, BLOCK_QH, BLOCK_HALF)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kt, stride_kh, stride_kot, stride_koh,
                  num_k_heads, cos, sin, half, BLOCK_KH, BLOCK_HALF)


def triton_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, hq, d], k: [T, hkv, d], positions: [T], cos/sin: [max_pos, d/2] (fp32 tables of
    RotaryEmbedding). Returns rotated (q, k) in their dtype: q and k themselves when inplace."""
    num_tokens, num_q_heads, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim and head_dim % 2 == 0
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "head dim must be contiguous"
    assert cos.shape == sin.shape and cos.stride() == sin.stride() and cos.shape[1] == head_dim // 2
    q_out = q if inplace else torch.empty_like(q)
    k_out = k if inplace else torch.empty_like(k)
    if num_tokens:
        _rope_kernel[(num_tokens,)](
            q, k, q_out, k_out, positions, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0),
            num_q_heads, k.shape[1], head_dim // 2,
            BLOCK_QH=triton.next_power_of_2(num_q_heads),
            BLOCK_KH=triton.next_power_of_2(k.shape[1]),
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2))
    return q_out, k_out
