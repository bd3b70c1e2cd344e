"""What changes when a kernel runs under the Triton CPU interpreter (TRITON_INTERPRET=1).

Triton kernels only run on CPU tensors through the interpreter, so the tensor's device tells us
which one we are in, even if TRITON_INTERPRET was flipped after triton was imported.
"""
from __future__ import annotations

import torch


def needs_fp32_dot(t: torch.Tensor) -> bool:
    """The interpreter stores bf16 as raw uint16 bits and its tl.dot multiplies those bits as
    integers, so bf16 operands must be widened to fp32 before tl.dot there. The widening is
    exact, and the GPU's bf16 MMA also accumulates exact products in fp32, so results agree."""
    return t.device.type == "cpu" and t.dtype == torch.bfloat16
