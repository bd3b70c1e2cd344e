"""Triton kernels of the engine, each beside a plain-torch reference of the same function.

On CUDA they run compiled; on CPU they run under the Triton interpreter (TRITON_INTERPRET=1 must
be set before these modules are imported, because @triton.jit reads it when it decorates).

The kernels are imported on first use (PEP 562), so that importing the package for its
triton-free parts (launch_config) neither imports triton nor fixes the interpreter
setting for the process too early.
"""
from importlib import import_module

_HOMES = {"triton_attention": "flash_attention", "triton_decode_attention": "decode_attention",
          "triton_kv_store": "kv_store", "triton_rmsnorm": "rmsnorm", "triton_rope": "rope",
          "triton_silu_mul": "silu_mul"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOMES[name]}"), name)
