"""Which implementation runs each op: plain torch (SDPA on CPU) or the Triton kernels.

`auto` picks Triton on CUDA and torch elsewhere; either can be forced. On a CPU the Triton path
runs under the interpreter, which needs TRITON_INTERPRET=1 set before triton is imported.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable

import torch

from engine.errors import ConfigError
from engine.rank import gemm, layer_ops, ops
from engine.rank.attention import torch_attention
from engine.rank.kv_cache import KVCache
from engine.rank.step_context import BackendOps
from parallel.comm import is_cuda

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    kv_store: Callable  # (cache, layer, k, v, slot_mapping): new K/V into their slots
    attention: Callable  # (layer, q, k, v, cache, meta, scale) -> out; k/v already stored
    decode_attention: Callable  # the same, for a step of one new token per sequence
    rmsnorm: Callable  # (x, residual | None, weight, eps) -> (normed, new residual)
    rope: Callable  # (positions, q, k, cos, sin) -> (q, k)
    silu_mul: Callable  # (gate_up) -> out
    linear: Callable = gemm.linear  # (x, weight, bias | None) -> x Wᵀ + b: every projection
    # (q, k, cos rows, sin rows) -> (q, k): RoPE at multipliers gathered once per eager step
    # (engine.rank.ops.rope_rows); None: `rope` gathers them itself in every layer
    rotate: Callable | None = None
    # (x, gate/up weight [gate; up], bias | None) -> SiLU(x W_gateᵀ) · (x W_upᵀ) as one fused
    # call (engine.rank.kernel_choice picks where it runs); None: `linear`, then `silu_mul`
    gated_linear: Callable | None = None

    def gated(self) -> Callable:
        """The MLP's gate/up product with its SiLU·mul applied: [T, ffn] from x [T, d]."""
        if self.gated_linear is not None:
            return self.gated_linear
        linear, silu_mul = self.linear, self.silu_mul

        def linear_then_silu_mul(x: torch.Tensor, weight: torch.Tensor,
                                 bias: torch.Tensor | None = None) -> torch.Tensor:
            return silu_mul(linear(x, weight, bias))
        return linear_then_silu_mul

    def step_ops(self, decode: bool) -> BackendOps:
        """The KV store and attention of an eager step; `decode`: one new token per sequence."""
        return BackendOps(self.kv_store, self.decode_attention if decode else self.attention)


TORCH = Backend("torch", KVCache.store, torch_attention, torch_attention, ops.rmsnorm, ops.rope,
                ops.silu_mul, rotate=ops.rotate)


def cpu_torch() -> Backend:
    """TORCH on a CPU: its small ops (RMSNorm, RoPE, SiLU·mul) in C++ (engine.rank.layer_ops)
    where that library builds here, each rotating at its rows' positions itself."""
    if not layer_ops.available():
        return TORCH
    return dataclasses.replace(TORCH, rmsnorm=layer_ops.rmsnorm, rope=layer_ops.rope,
                               silu_mul=layer_ops.silu_mul, rotate=None)


def _triton() -> Backend:
    import triton  # noqa: F401  (fails here, clearly, when triton is missing)

    from engine.rank import kernels

    name = "triton-interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "triton"
    return Backend(name, kernels.triton_kv_store, kernels.triton_attention,
                   kernels.triton_decode_attention, kernels.triton_rmsnorm, kernels.triton_rope,
                   kernels.triton_silu_mul)


def resolve_backend(name: str, device: str) -> str:
    """"torch" or "triton": what `name` resolves to on `device`; a choice that cannot run here
    fails now."""
    on_cuda = is_cuda(device)
    if name == "torch" or (name == "auto" and not on_cuda):
        return "torch"
    if name in ("triton", "auto"):
        if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("attention_backend='triton' on a CPU needs TRITON_INTERPRET=1 "
                              "set before the engine starts (slow: for tests only)")
        return "triton"
    raise ConfigError(f"attention_backend={name!r}: use one of {BACKENDS}")


def select_backend(name: str, device: str) -> Backend:
    """The backend `name` resolves to on `device` (resolve_backend)."""
    if resolve_backend(name, device) == "triton":
        return _triton()
    return TORCH if is_cuda(device) else cpu_torch()
