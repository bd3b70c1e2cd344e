"""The running-softmax update both attention kernels fold each key tile into."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # scores are scaled by log2(e) so the kernels can use exp2


def dot_precision(dtype: torch.dtype, fp32_dot: bool) -> str:
    """fp32 inputs (or fp32 dots asked for) get full-precision dots: tf32 would cost ~1e-3
    relative error; 16-bit inputs are exact in tf32 anyway."""
    return "ieee" if dtype == torch.float32 or fp32_dot else "tf32"


@triton.jit
def fold_tile(acc, m_i, l_i, s, v, PRECISION: tl.constexpr):
    """Fold scores s [M, N] (log2 units, -inf where masked) and values v [N, D] into the running
    max m_i, denominator l_i and unnormalised output acc. The caller guarantees every row has
    seen a finite score by its first tile, so m_new is finite and no NaN can appear."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i
