"""A few rows' product with quantized weights (quantized_rows.cpp), for decode steps:
weights="int8"'s projections and every quantized mode's LM head (int8 per channel), and
weights="int4" | "gguf"'s projections (GGUF's Q4 blocks).

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

import ctypes
from pathlib import Path

import torch

from engine.rank.cpp_library import CppLibrary
from engine.rank.quantized import KERNEL_ROWS, QuantizedWeight
from parallel import graph_op

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
LIBRARY = CppLibrary(
    Path(__file__).with_suffix(".cpp"), "quantized row product",
    {"int8_rows_product": [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _int, _int],
     "q4_rows_product": [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _int, _int],
     "q4_rows_supported": []},
    "quantized products keep torch's kernels")
DTYPES = (torch.float32, torch.bfloat16)
K_MULTIPLE = {"int8": 16, "int4": 32}  # int8: the widest vector's floats; int4: a Q4 group
_KERNEL = {"int8": "int8_rows_product", "int4": "q4_rows_product"}


def available(kind: str = "int8") -> bool:
    """Whether the kernel for `kind` ("int8" | "int4") is built here (int4 needs AVX2)."""
    library = LIBRARY.get()
    return library is not None and (kind == "int8" or library.q4_rows_supported() == 1)


def takes(weight: QuantizedWeight) -> bool:
    """Whether a kernel multiplies by this weight (of a dtype it is built for, on the CPU)."""
    return (weight.kind in K_MULTIPLE and weight.scales.dtype in DTYPES
            and weight.shape[1] % K_MULTIPLE[weight.kind] == 0
            and weight.codes.device.type == "cpu")


def _call(kind: str, x: torch.Tensor, n: int, k: int, dtype: torch.dtype,
          weight_ptrs: list[int]) -> torch.Tensor:
    """x [rows, k] (rows <= KERNEL_ROWS) times a weight of n outputs: [rows, n] in `dtype` (x
    is converted to it)."""
    library = LIBRARY.get()
    if library is None:
        raise RuntimeError("the quantized row product is not built on this machine")
    if x.dtype is not dtype or x.stride(-1) != 1:
        x = x.to(dtype).contiguous()
    y = x.new_empty(len(x), n)
    if len(x) == 0:
        return y
    kernel = _KERNEL[kind]
    status = getattr(library, kernel)(x.data_ptr(), x.stride(0), len(x), *weight_ptrs,
                                      y.data_ptr(), n, k, dtype is torch.bfloat16,
                                      torch.get_num_threads())
    if status == 2:
        raise MemoryError(f"{kernel}: no memory for its widened rows")
    if status == 3:
        raise RuntimeError(f"{kernel}: not built for this CPU (it needs AVX2)")
    if status != 0:
        raise ValueError(f"{kernel}: {len(x)} rows of {k} inputs; it takes 1-{KERNEL_ROWS} "
                         f"rows of a multiple of {K_MULTIPLE[kind]}")
    return y


def int8_product(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [rows, k] times the int8 weight whose codes are [n, k] and per-channel scales [n]."""
    return _call("int8", x, len(codes), codes.shape[1], scales.dtype,
                 [codes.data_ptr(), scales.data_ptr()])


def q4_product(x: torch.Tensor, nibbles: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """x [rows, k] times the int4 weight whose codes are `nibbles` [n, k/2] (GGUF's block
    layout) and whose groups' d and m are `steps` [2, n, k/32, 1] (w = d q + m)."""
    return _call("int4", x, len(nibbles), 2 * nibbles.shape[1], steps.dtype,
                 [nibbles.data_ptr(), steps[0].data_ptr(), steps[1].data_ptr()])


# the products as opaque ops for compiled graphs (a decode step's projections and LM head)
int8_rows = graph_op.define(
    "int8_rows(Tensor x, Tensor codes, Tensor scales) -> Tensor", int8_product,
    lambda x, codes, scales: x.new_empty(x.shape[0], codes.shape[0], dtype=scales.dtype))
q4_rows = graph_op.define(
    "q4_rows(Tensor x, Tensor nibbles, Tensor steps) -> Tensor", q4_product,
    lambda x, nibbles, steps: x.new_empty(x.shape[0], nibbles.shape[0], dtype=steps.dtype))


def linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x Wᵀ (+ b) for x [..., k] of at most KERNEL_ROWS rows, through the weight's kernel."""
    rows = x.reshape(-1, weight.shape[1])
    compiling = torch.compiler.is_compiling()
    if weight.kind == "int8":
        y = (int8_rows if compiling else int8_product)(rows, weight.codes, weight.scales)
    else:
        y = (q4_rows if compiling else q4_product)(rows, weight.nibbles, weight.steps)
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias
