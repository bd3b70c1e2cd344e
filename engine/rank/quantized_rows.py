"""A few rows' product with quantized weights (quantized_rows.cpp), for decode steps:
weights="int8"'s projections and every quantized mode's LM head (int8 per channel), and
weights="int4" | "gguf"'s projections (GGUF's Q4 blocks); and the op that runs a decode step's
layers around them in one call (engine.rank.quantized_layers).

For one row of SmolLM2's int8 LM head, torch's `_weight_int8pack_mm` read its codes at 13.5 GB/s
with bf16 activations and 2.5 with float32 ones, the int8 kernel at 31.9 and 31.5 (2 threads of
the AVX512 EPYC, `.venv/bin/python -m bench.cpu_ops --repeats 5`, BENCHMARKS.md session 42).
The int4 kernel rounds each row to int16 per group of 32 inputs (an error of at most 2^-16 of
the group's largest value, far below the 4-bit weights' own) so its products are integer
multiply-adds; bench.cpu_ops times it against `_weight_int4pack_mm_for_cpu`.
Which one runs is timed per weight shape on the machine (engine.rank.kernel_choice); where the
library cannot be built (or, for int4, the CPU has no AVX2), torch's runs.
"""
from __future__ import annotations

from pathlib import Path

import torch

from engine.rank.cpp_library import CppLibrary
from engine.rank.quantized import KERNEL_ROWS, QuantizedWeight
from parallel import graph_op

LIBRARY = CppLibrary(
    Path(__file__).with_suffix(".cpp"), "quantized row product",
    {"q4_rows_supported": [], "register_ops": []}, "quantized products keep torch's kernels",
    register="register_ops")
DTYPES = (torch.float32, torch.bfloat16)
K_MULTIPLE = {"int8": 16, "int4": 32, "float": 16}  # the widest vector's floats; int4: a Q4 group

# the ops, as eager code and compiled graphs call them; their CPU kernels come with the library
int8_rows = graph_op.declare(
    "int8_rows(Tensor x, Tensor codes, Tensor scales) -> Tensor",
    lambda x, codes, scales: x.new_empty(x.shape[0], codes.shape[0], dtype=scales.dtype))
q4_rows = graph_op.declare(
    "q4_rows(Tensor x, Tensor nibbles, Tensor steps) -> Tensor",
    lambda x, nibbles, steps: x.new_empty(x.shape[0], nibbles.shape[0], dtype=steps.dtype))

# parts of a decode step's layers (engine.rank.quantized_layers; part 2i: the listed layer i's
# attention, 2i + 1: its MLP; the cache's layer first_layer + i), the residual updated in place:
# per listed layer 2 norms, its 4 weights as 8 tensors (int8 codes and scales, int4 nibbles
# and steps, or a float model's weight and an empty tensor) and 2 biases
quantized_decode_layers = graph_op.declare(
    "quantized_decode_layers(Tensor x, Tensor(a!) residual, Tensor[] norms, float eps, "
    "Tensor[] weights, Tensor?[] biases, Tensor cos, Tensor sin, Tensor positions, "
    "Tensor(b!) cache, Tensor slot_mapping, Tensor block_table, Tensor context_lens, int q_heads, "
    "float scale, int first_layer, int first_part, int parts) -> Tensor",
    lambda x, *rest: torch.empty_like(x))


def available(kind: str = "int8") -> bool:
    """Whether the kernel for `kind` ("int8" | "int4") is built here (int4 needs AVX2)."""
    library = LIBRARY.get()
    return library is not None and (kind == "int8" or library.q4_rows_supported() == 1)


def takes(weight: QuantizedWeight) -> bool:
    """Whether a kernel multiplies by this weight (of a dtype it is built for, on the CPU)."""
    return (weight.kind in K_MULTIPLE and weight.scales.dtype in DTYPES
            and weight.shape[1] % K_MULTIPLE[weight.kind] == 0
            and weight.codes.device.type == "cpu")


def _loaded() -> None:
    if LIBRARY.get() is None:
        raise RuntimeError("the quantized row product is not built on this machine")


def int8_product(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [rows, k] (rows <= KERNEL_ROWS) times the int8 weight whose codes are [n, k] and
    per-channel scales [n]: [rows, n] in the scales' dtype (x is converted to it)."""
    _loaded()
    return int8_rows(x, codes, scales)


def q4_product(x: torch.Tensor, nibbles: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """x [rows, k] (rows <= KERNEL_ROWS) times the int4 weight whose codes are `nibbles`
    [n, k/2] (GGUF's block layout) and whose groups' d and m are `steps` [2, n, k/32, 1]
    (w = d q + m): [rows, n] in the steps' dtype (x is converted to it)."""
    _loaded()
    return q4_rows(x, nibbles, steps)


def linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x Wᵀ (+ b) for x [..., k] of at most KERNEL_ROWS rows, through the weight's kernel (the
    library is loaded: the kernel choice timed it)."""
    rows = x if x.dim() == 2 else x.reshape(-1, weight.shape[1])
    if weight.kind == "int8":
        y = int8_rows(rows, weight.codes, weight.scales)
    else:
        y = q4_rows(rows, weight.nibbles, weight.steps)
    if x.dim() != 2:
        y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias
