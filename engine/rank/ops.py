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
    return rotate(q, k, *rope_rows(positions, cos, sin))


def rope_rows(positions: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's multipliers [T, 1, d]: (c, c) and (-s, s) at each row's position. Every
    layer rotates at the same positions, so an eager step gathers them once
    (engine.rank.rotary), not in each of its layers."""
    c, s = cos.index_select(0, positions), sin.index_select(0, positions)
    return torch.cat((c, c), -1).unsqueeze(1), torch.cat((-s, s), -1).unsqueeze(1)


def rotate(q: torch.Tensor, k: torch.Tensor, c: torch.Tensor,
           s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by the multipliers of rope_rows. q and k side by side in one buffer
    (the QKV projection's output) are rotated in one pass: half the small ops of a decode
    step's RoPE."""
    both = _side_by_side(q, k)
    if both is None:
        return _rotated(q, c, s), _rotated(k, c, s)
    out = _rotated(both, c, s)
    return out[:, :q.shape[1]], out[:, q.shape[1]:]


def _side_by_side(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """[T, h + hkv, d]: q's heads then k's, when both are views of one tensor and k's begin
    where q's end in every row; else None."""
    heads_dim = (q.shape[2], 1)
    if (torch.compiler.is_compiling() or len(q) != len(k) or q.shape[2] != k.shape[2]
            # one storage (inference-mode views keep no `_base`; _cdata tells fake ones apart)
            or q.untyped_storage()._cdata != k.untyped_storage()._cdata
            or q.stride()[1:] != heads_dim or k.stride()[1:] != heads_dim
            or (len(q) > 1 and q.stride(0) != k.stride(0))  # one row: no row stride to match
            or k.storage_offset() != q.storage_offset() + q.shape[1] * q.shape[2]):
        return None  # a graph fuses the two passes itself
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())


def _rotated(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (x1 c - x2 s, x2 c + x1 s) in float32, rounded back to x's dtype, written as
    x (c, c) + (x2, x1) (-s, s): five ops where the halves took ten, the same float32 values
    (x2 (-s) is -(x2 s) exactly)."""
    h = x.float()
    half = h.shape[-1] // 2
    if torch.compiler.is_compiling():
        # the same values as the roll; inductor gathers a roll lane by lane (a modulo per
        # element) but vectorizes two slices: a bf16 512-token layer's RoPE of SmolLM2 took 104
        # against 155 us (AMX Xeon, a /tmp timing), where eagerly the roll is the faster op
        swapped = torch.cat((h[..., half:], h[..., :half]), -1)
    else:
        swapped = h.roll(half, -1)
    return (h * c).add_(swapped * s).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for the fused [T, 2n] gate/up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    # in place into SiLU's own fresh output: one allocation fewer (bf16 [512, 3072]: 0.47 vs
    # 0.82 ms on a Xeon with AMX), the same roundings
    return F.silu(gate).mul_(up)
