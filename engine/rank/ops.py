"""The small ops of a transformer layer in plain torch: the CPU path of the engine, and the
reference every Triton kernel in engine/rank/kernels is tested against."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise x + residual (or x alone); returns (normed, the sum, which is the new residual)."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), x


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, h, d] and k [T, hkv, d] by their positions (rotate-half layout); cos/sin are
    [max_positions, d/2] float32 tables."""
    c, s = cos.index_select(0, positions).unsqueeze(1), sin.index_select(0, positions).unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for the fused [T, 2n] gate/up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    # in place into SiLU's own fresh output: one allocation fewer (bf16 [512, 3072]: 0.47 vs
    # 0.82 ms on a Xeon with AMX), the same roundings
    return F.silu(gate).mul_(up)
