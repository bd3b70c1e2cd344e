"""Attention as fused CPU kernels (fused_attention.cpp), float32 or bf16: a prompt's causal
attention, and a decode step's over the paged KV cache.

torch's CPU flash kernel spends much of a prompt's attention outside its matrix products. This
one keeps a tile of queries' scores, softmax and output in the core's caches, runs the query
heads that share a KV head through each K/V tile together, and multiplies in register tiles of
the machine's widest vectors: one SmolLM2 layer's float32 2048-token prompt took 24.3 ms
against SDPA's 38.3, and a 512-token one 1.7 against 3.9 (2 threads of the AVX512-BF16 EPYC,
`.venv/bin/python -m bench.cpu_ops --only-prompt-attention --fused-from 8e201cc`, which also
times the kernel as it was before session 46: 1.09-1.30x slower; BENCHMARKS.md). On a Xeon with
AMX its bf16 products run in AMX tiles (`bf16_products()` says which way this build runs them).

A decode step's (`paged_decode`) stores the step's new K/V and reads each row's context through
its block table in one call, with spans of one row's keys spread over the threads; the compiled
decode graph calls it as one op per layer (engine.rank.padded_decode) where it timed faster
than the graph's own fused tensor math (engine.rank.kernel_choice): the op
prefill::fused_paged_decode (engine.rank.graph_ops), whose CPU kernel the library registers
when it loads, so a graph calls the C++ without Python in between.

It is C++ built on first use for this CPU (engine.rank.cpp_library). Where no compiler or build
works it is simply not a candidate (engine.rank.kernel_choice times it against SDPA, and a CPU
where SDPA is faster keeps SDPA).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.rank.attention import sdpa_attention
from engine.rank.cpp_library import CppLibrary
from parallel import graph_op

HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # the head sizes the kernel is built for
_i64, _ptr, _float, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
LIBRARY = CppLibrary(
    Path(__file__).with_suffix(".cpp"), "fused CPU attention",
    {"fused_causal_attention": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64,
                                _i64, _i64, _i64, _float, _int, _int],
     "bf16_products": [_i64], "register_ops": []},
    "prompts keep SDPA and decode graphs their own attention", register="register_ops")


def available() -> bool:
    """Whether the kernels are built (building them now if need be) and load on this machine."""
    return _kernels() is not None


# bf16: float32 sums of bf16 products (AMX tiles, AVX512-BF16 pair dot products, or widened
# copies)
DTYPES = (torch.float32, torch.bfloat16)
BF16_PRODUCTS = ("widened float32", "AVX512-BF16 pair dot products", "AMX tiles")


def bf16_products(head_dim: int = 64) -> str | None:
    """How a bf16 prompt's products run in this build, on this machine, for heads of
    `head_dim` (one of BF16_PRODUCTS; the kernel says which heads its AMX tiles take), or None
    where it is not built."""
    kernels = _kernels()
    return None if kernels is None else BF16_PRODUCTS[kernels.bf16_products(head_dim)]


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the fused kernel takes these queries and keys (CPU tensors of one of DTYPES, a
    head size it is built for, whole query groups per KV head); else the caller runs SDPA."""
    return (q.dtype == k.dtype == v.dtype and q.dtype in DTYPES
            and q.device.type == k.device.type == v.device.type == "cpu"
            and q.shape[-1] in HEAD_DIMS and q.shape[1] % k.shape[1] == 0
            and len(k) == len(v) >= len(q) > 0 and k.shape[1:] == v.shape[1:])


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q: [Tq, hq, d], the last Tq positions of a context whose keys/values are k, v [Tk, hkv, d]
    (query head h reads KV head h // (hq / hkv)). Returns [Tq, hq, d]. Inputs the kernel does
    not take (engine.rank.fused_attention.supports), or a machine without it: SDPA."""
    kernels = _kernels()
    if kernels is None or not supports(q, k, v):
        return sdpa_attention(q, k, v, scale, shared_kv=k.shape[1] != q.shape[1])
    q, k, v = (_heads_contiguous(t) for t in (q, k, v))
    out = torch.empty(q.shape, dtype=q.dtype)
    status = kernels.fused_causal_attention(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        out.data_ptr(), out.stride(0), len(q), len(k), q.shape[1], k.shape[1], q.shape[2], scale,
        q.dtype == torch.bfloat16, torch.get_num_threads())
    _check(status, f"causal attention of {len(q)} queries over {len(k)} keys")
    return out


def takes_paged_decode(dtype: torch.dtype, head_dim: int, kv_head_of_q: list[int]) -> bool:
    """Whether `paged_decode` runs a CPU decode step of this dtype and head size where query
    head h reads KV head kv_head_of_q[h]: it reads whole groups of consecutive query heads per
    KV head."""
    group = len(kv_head_of_q) // max(1, len(set(kv_head_of_q)))
    return (dtype in DTYPES and head_dim in HEAD_DIMS and len(kv_head_of_q) > 0
            and list(kv_head_of_q) == [h // group for h in range(len(kv_head_of_q))])


def paged_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                 layer: int, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """A decode step of one layer: the new k, v [rows, hkv, d] into their slots
    (`slot_mapping` [rows]) of `layer` in `cache` ([k|v, layer, block, slot, hkv, d]), then
    each row's query q [rows, hq, d] over the first context_lens[row] tokens of its blocks
    (`block_table` [rows, width]). Returns [rows, hq, d]. Only where `takes_paged_decode`
    and `available()`; an index outside the cache raises IndexError, nothing written."""
    if _kernels() is None:
        raise RuntimeError("the fused CPU attention is not built on this machine")
    return fused_paged_decode(q, k, v, cache, layer, slot_mapping, block_table, context_lens,
                              scale)


# The op the compiled decode graph calls (engine.rank.padded_decode); its CPU kernel, which
# checks the arguments as paged_decode says, is fused_attention.cpp's, registered when the
# library loads: a graph calls the C++ with no Python in between.
fused_paged_decode = graph_op.declare(
    "fused_paged_decode(Tensor q, Tensor k, Tensor v, Tensor(a!) cache, SymInt layer, "
    "Tensor slot_mapping, Tensor block_table, Tensor context_lens, float scale) -> Tensor",
    lambda q, *rest: q.new_empty(q.shape))


def _check(status: int, what: str) -> None:
    if status == 1:
        raise RuntimeError(f"{what}: the fused attention has no kernel for this head size")
    if status == 2:
        raise MemoryError(f"{what}: no memory for the fused attention's buffers")


def source_hash() -> str:
    """The kernels' source, hashed: what their timings (engine.rank.kernel_choice) hold for."""
    return LIBRARY.source_hash()


def _heads_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t with each row's heads side by side (rows may be strided, as the QKV output's views)."""
    if t.stride(2) == 1 and t.stride(1) == t.shape[2]:
        return t
    return t.contiguous()


def _kernels() -> ctypes.CDLL | None:
    return LIBRARY.get()
