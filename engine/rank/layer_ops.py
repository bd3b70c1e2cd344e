"""A decoder layer's small ops on a CPU as C++ kernels (layer_ops.cpp): RMSNorm with its
residual add, RoPE, SiLU·mul, each one pass over its rows, computing what engine.rank.ops
computes with its roundings.

They are registered ops (prefill::add_rmsnorm, prefill::rope, prefill::silu_mul), so a prompt's
compiled graph calls each as one opaque step instead of inductor's code for the same math (its
RoPE wrote float32 copies of q's and k's halves, on one thread where it gathered the cos/sin
rows); eager steps call them too. A CPU rank's backend takes these
functions only where the library builds (engine.rank.backend.cpu_torch); tensors they do not
take (not float32/bf16, not on a CPU, a decode graph's few rows) run torch's code
(engine.rank.ops).
"""
from __future__ import annotations

from pathlib import Path

import torch

from engine.rank import ops
from engine.rank.cpp_library import CppLibrary
from engine.rank.gemm import EAGER_ROWS
from parallel import graph_op

LIBRARY = CppLibrary(Path(__file__).with_suffix(".cpp"), "CPU layer ops", {"register_ops": []},
                     "the small ops stay torch's", register="register_ops")
DTYPES = (torch.float32, torch.bfloat16)

add_rmsnorm_op = graph_op.declare(
    "add_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
    lambda x, residual, weight, eps: (torch.empty_like(x), torch.empty_like(x)))
rope_op = graph_op.declare(
    "rope(Tensor positions, Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)",
    lambda positions, q, k, cos, sin: (q.new_empty(q.shape), k.new_empty(k.shape)))
silu_mul_op = graph_op.declare(
    "silu_mul(Tensor gate_up) -> Tensor",
    lambda gate_up: gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2))


def available() -> bool:
    """Whether the kernels are built (building them now if need be) and load here."""
    return LIBRARY.get() is not None


def _takes(x: torch.Tensor) -> bool:
    """Whether x's rows take the C++ op: float32 or bf16 on a CPU, eagerly or in a prompt's
    graph (more than EAGER_ROWS rows: a graph's dynamic row count starts there, so this asks
    no guard), not in a decode graph of a few rows, where inductor fuses torch's ops into the
    code around them."""
    few_graph_rows = torch.compiler.is_compiling() and x.shape[0] <= EAGER_ROWS
    return x.device.type == "cpu" and x.dtype in DTYPES and not few_graph_rows


def rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """engine.rank.ops.rmsnorm: (normed x + residual, x + residual)."""
    if residual is None or not _takes(x) or x.dim() != 2 or weight.dtype != x.dtype:
        return ops.rmsnorm(x, residual, weight, eps)
    return add_rmsnorm_op(x, residual, weight, eps)


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """engine.rank.ops.rope: q and k rotated by their rows' positions."""
    if not _takes(q) or k.dtype != q.dtype:
        return ops.rope(positions, q, k, cos, sin)
    return rope_op(positions, q, k, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """engine.rank.ops.silu_mul: SiLU(gate) * up."""
    if not _takes(gate_up) or gate_up.dim() != 2:
        return ops.silu_mul(gate_up)
    return silu_mul_op(gate_up)
