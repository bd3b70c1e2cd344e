"""Fused residual add + RMSNorm, with the semantics of engine.rank.model.RMSNorm.forward."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.rank.ops import rmsnorm as rmsnorm_reference  # noqa: F401  (the plain-torch function this kernel replaces)


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                    stride_x, stride_res, stride_out, stride_res_out, hidden, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # one program per row; a whole row fits in one block for any hidden size in use (<= 16k)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        # rounded to x's dtype like torch's x + residual, since that sum is what is normalised
        # and what the next layer adds to
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
    # the reference rounds the normalised row to x's dtype before scaling by the weight
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    out = h.to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def triton_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., hidden]. Returns (normed, new residual) with new residual = x + residual,
    or x itself when residual is None. normed has the dtype torch gives weight * x (x's dtype when
    the weight shares it)."""
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    assert rows.stride(-1) == 1 and weight.is_contiguous(), "hidden dim must be contiguous"
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if residual is None:
        res_in, res_out = rows, rows  # never read nor written: HAS_RESIDUAL is False
    else:
        res_in = residual.reshape(-1, hidden)
        assert res_in.stride(-1) == 1, "hidden dim must be contiguous"
        res_out = torch.empty_like(rows)
    block = triton.next_power_of_2(hidden)
    if len(rows):
        # about 512 elements per warp: wide rows get more warps instead of spilling registers
        _rmsnorm_kernel[(len(rows),)](
            rows, res_in, weight, out, res_out,
            rows.stride(0), res_in.stride(0), out.stride(0), res_out.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(16, max(1, block // 512)))
    new_residual = x if residual is None else res_out.view(x.shape)
    return out.view(x.shape), new_residual
