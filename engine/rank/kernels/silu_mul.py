"""SiLU-gated product of the MLP: silu(gate) * up from the fused gate_up projection."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.rank.ops import silu_mul as silu_mul_reference  # noqa: F401  (the plain-torch function this kernel replaces)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, n, stride_in, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + n + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # rounded to the input dtype before the product, as torch's silu(gate) * up does
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def triton_silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """gate_up: [T, 2n] (gate then up along the last dim) -> silu(gate) * up, [T, n]."""
    num_rows, width = gate_up.shape
    assert width % 2 == 0 and gate_up.stride(-1) == 1, gate_up.shape
    n = width // 2
    out = torch.empty((num_rows, n), dtype=gate_up.dtype, device=gate_up.device)
    block = min(block, triton.next_power_of_2(n))
    if num_rows:
        _silu_mul_kernel[(num_rows, triton.cdiv(n, block))](
            gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out
