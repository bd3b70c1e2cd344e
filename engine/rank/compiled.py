"""`compile=True`: each decoder layer runs as `torch.compile`d graphs (fused norms, RoPE and
SiLU·mul; dynamic token count), with the KV store, attention and collectives left opaque between
them: they index the paged cache with per-step metadata and talk to other ranks, which graphs
should not capture. Compilation (and Triton's, for the triton backend) happens in a warm-up when
the rank starts, never inside a request's step; a failed compile falls back to eager with one
warning."""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch
from torch import nn

from engine.rank.attention import KVStore, PagedAttention
from parallel.layers import AllReduce, GatherToRankZero

log = logging.getLogger("engine")
_OPAQUE = (KVStore, PagedAttention, AllReduce, GatherToRankZero)


class CompiledLayers:
    """Switches a model's layers between compiled and eager forwards."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.usable = True  # False once compiling failed here: eager from then on
        self._compiled = [torch.compile(layer.forward, dynamic=True) for layer in model.layers]
        for module in model.modules():
            if isinstance(module, _OPAQUE):
                module.forward = torch.compiler.disable(module.forward)

    def set(self, compiled: bool) -> None:
        for layer, graph in zip(self.model.layers, self._compiled):
            if compiled and self.usable:
                layer.forward = graph
            else:
                layer.__dict__.pop("forward", None)  # back to the class's eager forward


def warm_up(run_step: Callable[[int, int], None], layers: CompiledLayers | None = None) -> float:
    """Run the shapes steps take (a prompt, a longer one, a decode step) before any request
    arrives, so torch.compile and Triton's compilation and autotuning happen here, not inside a
    request's step timeout; seconds taken. If the compiled layers fail, they stay eager."""
    start = time.perf_counter()
    if layers is not None:
        layers.set(True)
        try:
            _run_shapes(run_step)
            return time.perf_counter() - start
        except Exception as e:  # noqa: BLE001  an unsupported setup must not stop the engine
            layers.usable = False
            layers.set(False)
            log.warning("compile=True failed on this setup (%s: %s); running eagerly instead",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
    _run_shapes(run_step)
    return time.perf_counter() - start


def _run_shapes(run_step: Callable[[int, int], None]) -> None:
    for num_tokens, start_position in ((16, 0), (48, 0), (1, 48)):
        run_step(num_tokens, start_position)
