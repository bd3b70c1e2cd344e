"""A few rows' product with int8 per-channel weights (int8_rows.cpp): weights="int8"'s
projections and every quantized mode's LM head, in decode steps.

For one row of SmolLM2's int8 LM head, torch's `_weight_int8pack_mm` read its codes at 13.5 GB/s
with bf16 activations and 2.5 with float32 ones, this kernel at 31.9 and 31.5 (2 threads of the
AVX512 EPYC, `.venv/bin/python -m bench.cpu_ops --repeats 5`, BENCHMARKS.md session 42).
Which one runs is timed per weight shape on the machine (engine.rank.kernel_choice); where the
library cannot be built, torch's runs.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.rank.cpp_library import CppLibrary
from engine.rank.quantized import KERNEL_ROWS, QuantizedWeight
from parallel import graph_op

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
LIBRARY = CppLibrary(
    Path(__file__).with_suffix(".cpp"), "int8 row product",
    {"int8_rows_product": [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _int, _int]},
    "int8 products keep torch's kernel")
DTYPES = (torch.float32, torch.bfloat16)
K_MULTIPLE = 16  # the widest vector's floats: inputs come in whole vectors


def available() -> bool:
    return LIBRARY.get() is not None


def takes(weight: QuantizedWeight) -> bool:
    """Whether the kernel multiplies by this weight (an int8 one, of a dtype it is built for)."""
    return (weight.kind == "int8" and weight.scales.dtype in DTYPES
            and weight.shape[1] % K_MULTIPLE == 0 and weight.codes.device.type == "cpu")


def product(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [rows, k] (rows <= KERNEL_ROWS) times the int8 weight whose codes are [n, k] and
    per-channel scales [n]: [rows, n] in the scales' dtype (x is converted to it)."""
    library = LIBRARY.get()
    if library is None:
        raise RuntimeError("the int8 row product is not built on this machine")
    if x.dtype is not scales.dtype or x.stride(-1) != 1:
        x = x.to(scales.dtype).contiguous()
    y = x.new_empty(len(x), len(codes))
    if len(x) == 0:
        return y
    status = library.int8_rows_product(
        x.data_ptr(), x.stride(0), len(x), codes.data_ptr(), scales.data_ptr(), y.data_ptr(),
        len(codes), codes.shape[1], x.dtype is torch.bfloat16, torch.get_num_threads())
    if status == 2:
        raise MemoryError("int8 row product: no memory for its widened rows")
    if status != 0:
        raise ValueError(f"int8 row product: {len(x)} rows of {codes.shape[1]} inputs; it takes "
                         f"1-{KERNEL_ROWS} rows of a multiple of {K_MULTIPLE}")
    return y


# the product as an opaque op for compiled graphs (a decode step's LM head)
int8_rows = graph_op.define(
    "int8_rows(Tensor x, Tensor codes, Tensor scales) -> Tensor", product,
    lambda x, codes, scales: x.new_empty(x.shape[0], codes.shape[0], dtype=scales.dtype))


def linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x Wᵀ (+ b) for x [..., k] of at most KERNEL_ROWS rows, through the kernel."""
    rows = x.reshape(-1, weight.shape[1])
    call = int8_rows if torch.compiler.is_compiling() else product
    y = call(rows, weight.codes, weight.scales).reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias
