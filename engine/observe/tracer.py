"""Per-rank record of every op a forward runs: its shapes, FLOPs, bytes moved and time.

The tracer observes the model from outside, with forward hooks on the modules that are ops
(linears, norms, rope, KV write, attention, collectives, the sampler). Nothing is registered
while tracing is off, so an untraced (or compiled) model pays nothing. Each op is timed between
device synchronisations, so the numbers are the op's own, not the queue's; an op's time excludes
the ops nested in it (a row-parallel linear's all-reduce is its own record; one started without
waiting, under overlap_comm, records its launch: the wait is the step's exposed communication).

An op's layer is read from its module's name (`layers.3.mlp.down_proj`), so ops are attributed
whether or not the decoder layer's own forward runs (overlap_comm calls its parts directly); a
module shared by every layer (the rotary embedding) takes the layer of the op before it.
"""
from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from engine.observe.costs import op_cost

# a module's attribute name -> the op it is; modules not named here are containers
OP_NAMES = {
    "embed_tokens": "embedding", "input_layernorm": "input_norm", "qkv_proj": "qkv_proj",
    "rotary_emb": "rope", "kv_store": "kv_write", "attn": "attention", "o_proj": "o_proj",
    "all_reduce": "all_reduce", "post_attention_layernorm": "post_attn_norm",
    "gate_up_proj": "gate_up_proj", "down_proj": "down_proj",
    "norm": "final_norm", "lm_head": "lm_head", "gather": "gather_logits", "sampler": "sample",
}
_COLLECTIVES = ("all_reduce", "gather_logits")
_LAYER = re.compile(r"^layers\.(\d+)\.")


@dataclass(slots=True)
class OpRecord:
    name: str
    layer: int  # -1 outside the transformer layers
    rank: int
    shapes: str
    flops: int
    bytes: int
    start_s: float
    time_s: float

    def to_dict(self) -> dict:
        return asdict(self)


class OpTracer:
    """`with OpTracer(rank, device, [("", model), ("sampler", sampler)]) as t:` ...
    `t.records`. Each root's modules are named under its prefix; two roots may share one (the
    model and its decode-weights view)."""

    def __init__(self, rank: int, device: torch.device, roots: list[tuple[str, nn.Module]],
                 world_size: int = 1):
        """`world_size`: ranks in the tensor-parallel group (collectives of one are dropped)."""
        self.rank, self.cuda, self.world_size = rank, device.type == "cuda", world_size
        self.records: list[OpRecord] = []
        self._roots = roots
        self._handles: list = []
        self._layer = -1
        self._open: list[list[float]] = []  # per running op: [start, seconds of nested ops]
        self._origin = time.perf_counter()

    def __enter__(self) -> "OpTracer":
        for prefix, root in self._roots:
            names: dict[nn.Module, list[str]] = {}
            for name, module in root.named_modules(prefix=prefix, remove_duplicate=False):
                names.setdefault(module, []).append(name)
            for module, [name, *others] in names.items():
                self._attach(name, module, shared=bool(others))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.records.sort(key=lambda r: r.start_s)  # a nested op ends, so is recorded, first

    def _attach(self, name: str, module: nn.Module, shared: bool) -> None:
        op = OP_NAMES.get(name.rsplit(".", 1)[-1])
        if op is None:
            return
        in_layer = _LAYER.match(name)
        layer = None if shared else int(in_layer.group(1)) if in_layer else -1
        self._handles.append(module.register_forward_pre_hook(
            lambda *_: self._begin(layer)))
        self._handles.append(module.register_forward_hook(
            lambda mod, args, _out: self._end(op, mod, args)))

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _begin(self, layer: int | None) -> None:
        if layer is not None:  # None: a shared module, in the layer of the op before it
            self._layer = layer
        self._open.append([self._now(), 0.0])

    def _end(self, op: str, module: nn.Module, args: tuple) -> None:
        end = self._now()
        start, nested = self._open.pop()
        if self._open:
            self._open[-1][1] += end - start
        if op in _COLLECTIVES and self.world_size == 1:
            return  # a world of one communicates nothing: no op to show
        shapes, flops, nbytes = op_cost(op, module, args)
        self.records.append(OpRecord(op, self._layer, self.rank, shapes, int(flops), int(nbytes),
                                     start - self._origin, end - start - nested))
