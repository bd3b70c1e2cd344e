"""Ops of the `prefill` namespace that compiled graphs call as opaque steps (the KV store,
attention, the all-reduce, oneDNN's product, the quantized row products), defined straight
through `torch.library.Library`.

Not `torch.library.custom_op`, whose Python wrapper adds tens of microseconds to every call:
`python -m bench.cpu_ops --repeats 5 --dtypes bfloat16` times the decode graph's KV store (one
row) at 52 us a call as a custom_op against 16 us defined here, the store's own work included
(AMX Xeon, 2 threads, torch 2.13), and a decode graph calls it once per layer, 30 times a
SmolLM2 step: ~1.1 ms a step.
"""
from __future__ import annotations

from typing import Callable

import torch

_LIBRARY = torch.library.Library("prefill", "FRAGMENT")


def define(schema: str, impl: Callable, fake: Callable) -> torch._ops.OpOverload:
    """The op `prefill::<schema>`: `impl` runs it on every device, `fake` gives its output's
    shape when graphs are traced. An argument the op writes is marked `Tensor(a!)` in the
    schema, so a graph orders the op against the tensor's other readers."""
    op = declare(schema, fake)
    _LIBRARY.impl(schema.split("(", 1)[0], impl, "CompositeExplicitAutograd")
    return op


def declare(schema: str, fake: Callable) -> torch._ops.OpOverload:
    """The op `prefill::<schema>` whose kernels a C++ library registers when it loads (as
    engine/rank/quantized_rows.cpp does): declared here so that graphs can be traced (`fake`)
    and kept graphs loaded before the library is."""
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema)
    torch.library.register_fake(f"prefill::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.prefill, name).default
