"""Triton kernels of the engine, each beside a plain-torch reference of the same function.

On CUDA they run compiled; on CPU they run under the Triton interpreter (TRITON_INTERPRET=1 must
be set before these modules are imported, because @triton.jit reads it when it decorates).
"""
from engine.rank.kernels.decode_attention import triton_decode_attention
from engine.rank.kernels.flash_attention import triton_attention
from engine.rank.kernels.kv_store import triton_kv_store
from engine.rank.kernels.rmsnorm import triton_rmsnorm
from engine.rank.kernels.rope import triton_rope
from engine.rank.kernels.silu_mul import triton_silu_mul
from engine.rank.kernels.step_metadata import StepMetadata, build_step_metadata

__all__ = ["StepMetadata", "build_step_metadata", "triton_attention", "triton_decode_attention",
           "triton_kv_store", "triton_rmsnorm", "triton_rope", "triton_silu_mul"]
