"""A decode step's layers with quantized weights (weights="int8" | "int4" | "gguf"), each as two
C++ calls: `quantized_attention_half` (RMSNorm, QKV product, RoPE, KV store and attention, O
product) and `quantized_mlp_half` (RMSNorm, gate/up product, SiLU·mul, down product), both in
quantized_rows.cpp. One rank only: with tp > 1 each half would be followed by its all-reduce,
which no test here runs yet, so such ranks decode as before.

A compiled decode graph ran the same kernels but made ~9 kernel and op calls per layer from
inductor's Python, with ~24 size checks and dynamo's and AOTAutograd's wrappers around it: ~2 ms
of a ~6.4 ms 4-bit SmolLM2 step on the AVX512-BF16 EPYC (BENCHMARKS.md, session 51). The halves
run the products' kernels that KernelChoice timed faster than torch's for every projection shape
(`quantized_rows_shapes`) and the fused decode attention; where either is missing, decode steps
run as before. Rows go through the products 4 at a time (quantized.KERNEL_ROWS), so a step of any
number of sequences takes this path.

Roundings follow the eager layer's (engine.rank.ops): the residual sum, the normalised row and its
product with the norm's weight, RoPE's float32 result, SiLU(gate) and its product with up are
each rounded to the activations' dtype. The sums of squares and RoPE's products are summed in
another order, so a bf16 value can round the other way: tests hold the layer to the eager one's
result within a bound.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.rank import fused_attention, quantized_rows
from engine.rank.quantized import QuantizedWeight
from engine.rank.step_context import StepContext


def _pair(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The two tensors the halves take for a weight: int8 (codes, scales), int4 (nibbles, steps)."""
    return (weight.codes, weight.scales) if weight.kind == "int8" else (weight.nibbles, weight.steps)


@dataclass(slots=True, frozen=True)
class _Layer:
    """One layer's arguments to the halves, gathered once."""

    index: int
    attention: tuple  # norm, eps, qkv codes/scales/bias, o codes/scales, cos, sin
    mlp: tuple  # norm, eps, gate/up codes/scales/bias, down codes/scales
    q_heads: int
    scale: float


def unfit_reason(model: nn.Module, picked: set[tuple[str, tuple[int, int]]],
                 kv_head_of_q: list[int]) -> str | None:
    """Why `model`'s decode steps cannot run as halves here (None: they can). `picked`: the
    (kind, shape) of quantized weights whose products run the C++ kernels (KernelChoice)."""
    if model.tp.world_size() > 1:
        return "tp > 1"
    layer = model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not all(isinstance(p.weight, QuantizedWeight) for p in projections):
        return "the projections are not quantized"
    if attn.o_proj.bias is not None or mlp.down_proj.bias is not None:
        return "a row-parallel projection has a bias"
    if not all((p.weight.kind, p.weight.shape) in picked for m in model.layers
               for p in (m.self_attn.qkv_proj, m.self_attn.o_proj, m.mlp.gate_up_proj,
                         m.mlp.down_proj)):
        return "torch's kernels timed faster for a projection shape"
    dtype = projections[0].weight.dtype
    if not (fused_attention.takes_paged_decode(dtype, attn.head_dim, kv_head_of_q)
            and fused_attention.available()):
        return "the fused decode attention does not take these heads here"
    return None


class QuantizedDecode:
    """Runs a decode step's layers as halves; its context is a decode graph's (padded_decode's
    PaddedDecode meta: int32 slots, block table and lengths), padded to no bucket."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._layers = [self._gathered(i, layer) for i, layer in enumerate(model.layers)]

    @staticmethod
    def _gathered(index: int, layer: nn.Module) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        rope = attn.rotary_emb
        return _Layer(
            index,
            (layer.input_layernorm.weight, layer.input_layernorm.eps,
             *_pair(attn.qkv_proj.weight), attn.qkv_proj.bias, *_pair(attn.o_proj.weight),
             rope.cos, rope.sin),
            (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
             *_pair(mlp.gate_up_proj.weight), mlp.gate_up_proj.bias, *_pair(mlp.down_proj.weight)),
            attn.qkv_proj.q_size // attn.head_dim, attn.attn.scale)

    @torch.inference_mode()
    def logits(self, ctx: StepContext) -> torch.Tensor:
        """This rank's logits slice of every row, before the gather."""
        x, residual = self.layers(ctx)
        x, _ = self.model.norm(x, residual)
        return self.model.lm_head.local(x)

    def layers(self, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) of every row after the last layer, before the final norm."""
        model, meta, cache = self.model, ctx.meta, ctx.cache.data
        x = model.embed_tokens(ctx.token_ids)
        residual = torch.zeros_like(x)  # the first layer's: x + 0 is x
        step = (ctx.positions, cache)
        tables = (meta.slot_mapping, meta.block_table, meta.context_lens)
        for args in self._layers:
            x, residual = quantized_rows.quantized_attention_half(
                x, residual, *args.attention, *step, args.index, *tables, args.q_heads, args.scale)
            x, residual = quantized_rows.quantized_mlp_half(x, residual, *args.mlp)
        return x, residual
