"""A decode step's layers with quantized weights (weights="int8" | "int4" | "gguf"), or a float
model's (below), as one C++ call, `quantized_decode_layers` (quantized_rows.cpp): per layer
RMSNorm, the QKV product, RoPE, the KV store and attention (the fused decode attention's kernel,
through torch's dispatcher), the O product, RMSNorm, the gate/up product, SiLU·mul and the down
product.

A compiled decode graph ran the same products' kernels but made ~9 kernel and op calls per layer
from inductor's Python, with ~24 size checks and dynamo's and AOTAutograd's wrappers around it.
In one call SmolLM2's Q4_1 decode ran 1.39-1.41x as fast as through that graph, in float32 and
bf16 (AVX512-BF16 EPYC, `.venv/bin/python -m bench.peers --systems engine engine-gguf vllm
--dtypes float32 bfloat16 --repeats 5 --lengths 512 2048 --engine-from 5ff3680`, BENCHMARKS.md
session 51). The layers run the C++ products where KernelChoice timed them faster than torch's
for a layer's projections together, and the fused decode attention; where either is missing,
decode steps run as before. Rows go through the products 4 at a time, so a step of any number of
sequences takes this path. With tp > 1 each part of a layer (its attention, its MLP) ends in an
all-reduce: such ranks make a call per part, given only that layer's tensors, with the sum over
the ranks between calls. A tp=2 engine's 4-bit SmolLM2 decode so ran 84.4-88.4 tok/s against
43.6-45.7 through the eager layers (AVX512-BF16 EPYC, one thread a rank, shared-memory sums;
`.venv/bin/python -m bench.tp_scaling --lengths 256 --tp 2 --all-reduce shared --dtype bfloat16
--weights gguf`, against a copy of the code with the parts off, BENCHMARKS.md).

A float32 or bf16 model's decode steps may take the same call: the op multiplies its weights as
they are (a bf16 weight widened as it is read, float32 sums), and a one-rank compiled CPU engine
times a decode step as this call beside its decode graphs and eager steps after the warm-up
(Worker._choose_graph_steps, `graph-decode`: `one-call`). On the Zen 5 EPYC of session 59 it
decoded SmolLM2 1.34x (bf16) and 1.13x (float32) as fast as the graphs it replaced
(`.venv/bin/python -m bench.peers --systems engine vllm --dtypes float32 bfloat16
--engine-from 97d0650`, BENCHMARKS.md): the graphs' Python between layers left a core waiting.
An eager one-rank engine times its decode step as the call against eager steps, and the ranks
of a tp > 1 CPU engine as a call per part against the way they run it otherwise, all taking
rank 0's pick (Worker._choose_decode_call). On that EPYC an eager rank decoded 2.0x (float32)
and 2.4x (bf16) as fast so (`.venv/bin/python -m bench.peers --systems engine-eager --dtypes
float32 bfloat16 --engine-from 1c3a601 --lengths 512 --repeats 3`), two one-thread ranks
1.3-1.45x and 1.6x (`.venv/bin/python -m bench.tp_scaling --lengths 256 --tp 2 --all-reduce
shared --dtype float32|bfloat16`; BENCHMARKS.md session 60).

Roundings follow the eager layer's (engine.rank.ops): the residual sums, the normalised rows and
their products with the norms' weights, RoPE's float32 result, SiLU(gate) and its product with up
are each rounded to the activations' dtype. Sums of squares, RoPE's products and SiLU's exp are
computed otherwise than torch's, so a bf16 value can round the other way: tests hold the layers
to a float64 reference within a bound.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.rank import fused_attention, quantized_rows
from engine.rank.quantized import KERNEL_ROWS, QuantizedWeight
from engine.rank.step_context import StepContext


def _pair(weight: QuantizedWeight | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two tensors the op takes for a weight: int8 (codes, scales), int4 (nibbles, steps),
    a float weight (its values, no scales)."""
    if not isinstance(weight, QuantizedWeight):
        return weight, weight.new_empty(0)
    return (weight.codes, weight.scales) if weight.kind == "int8" else (weight.nibbles, weight.steps)


def _projections(layer: nn.Module) -> tuple[nn.Module, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def unfit_reason(model: nn.Module, seconds: dict[tuple[str, tuple[int, int]], dict[str, float]],
                 kv_head_of_q: list[int]) -> str | None:
    """Why `model`'s quantized decode steps cannot run as one call here (None: they can).
    `seconds`: each quantized (kind, shape)'s timed product, per kernel
    (KernelChoice.quantized_rows_seconds). The call runs the C++ products for all of a layer's
    projections, so it is taken where they timed faster together than torch's: a shape picked
    apart by a few percent either way (the SmolLM2 gate/up's was, from run to run) must not turn
    it off."""
    if not all(isinstance(p.weight, QuantizedWeight) for p in _projections(model.layers[0])):
        return "the projections are not quantized"
    shapes = {(p.weight.kind, p.weight.shape) for m in model.layers for p in _projections(m)}
    timed = [seconds.get(shape, {}) for shape in shapes]
    if not all("fused" in t and "torch" in t for t in timed):
        return "the C++ row products were not timed for every projection (kernel_choice='fixed')"
    fused, torch_s = (sum(t[k] for t in timed) for k in ("fused", "torch"))
    if fused > torch_s:
        return (f"torch's products timed faster together ({torch_s * 1e3:.3g} against "
                f"{fused * 1e3:.3g} ms a layer)")
    return _layers_unfit(model, kv_head_of_q)


def float_unfit_reason(model: nn.Module, kv_head_of_q: list[int]) -> str | None:
    """Why a float model's decode steps cannot run as one call here (None: they can; a step
    timed each way after the warm-up decides whether they do, Worker._choose_graph_steps)."""
    weights = [p.weight for m in model.layers for p in _projections(m)]
    if any(isinstance(w, QuantizedWeight) for w in weights):
        return "the projections are quantized"
    if not all(w.device.type == "cpu" and w.dtype in quantized_rows.DTYPES and w.is_contiguous()
               and w.shape[1] % quantized_rows.K_MULTIPLE["float"] == 0 for w in weights):
        return ("the projections are not contiguous float32/bfloat16 CPU weights with inputs "
                f"in multiples of {quantized_rows.K_MULTIPLE['float']}")
    if not quantized_rows.available():
        return "the C++ layers are not built here"
    return _layers_unfit(model, kv_head_of_q)


def _layers_unfit(model: nn.Module, kv_head_of_q: list[int]) -> str | None:
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    if attn.o_proj.bias is not None or mlp.down_proj.bias is not None:
        return "a row-parallel projection has a bias"
    if not (fused_attention.takes_paged_decode(attn.o_proj.weight.dtype, attn.head_dim,
                                               kv_head_of_q) and fused_attention.available()):
        return "the fused decode attention does not take these heads here"
    return None


class DecodeLayersCall:
    """Runs a decode step's layers in one call; its context is a decode graph's (padded_decode's
    PaddedDecode meta: int32 slots, block table and lengths), padded to no bucket."""

    def __init__(self, model: nn.Module, head: nn.Module | None = None):
        """`head`: the view whose final norm and LM head give the logits (a bf16 model's decode
        view, whose LM head may read a packed copy); `model` by default."""
        self.model, self.head = model, head or model
        attn = model.layers[0].self_attn
        self._heads = (attn.qkv_proj.q_size // attn.head_dim, attn.attn.scale)
        self._rotary = (attn.rotary_emb.cos, attn.rotary_emb.sin)
        # the op's lists for every layer (one rank) and for each layer alone (tp > 1, a call per
        # part: converting 30 layers' 360 tensors at each of 60 calls took more than the parts)
        self._all = self._lists(model.layers)
        self._each = [self._lists([layer]) for layer in model.layers]

    @staticmethod
    def _lists(layers) -> tuple:
        """(norms, eps, weights, biases) for these layers, as the op takes them."""
        norms, weights, biases = [], [], []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                weights += _pair(proj.weight)
            biases += [attn.qkv_proj.bias, mlp.gate_up_proj.bias]
        return norms, layers[0].input_layernorm.eps, weights, biases

    @torch.inference_mode()
    def logits(self, ctx: StepContext) -> torch.Tensor:
        """This rank's logits slice of every row, before the gather."""
        meta, model = ctx.meta, self.model
        x = model.embed_tokens(ctx.token_ids)
        residual = torch.zeros_like(x)

        def run(x: torch.Tensor, lists: tuple, first_layer: int, first_part: int,
                parts: int) -> torch.Tensor:
            return quantized_rows.quantized_decode_layers(
                x, residual, *lists, *self._rotary, ctx.positions, ctx.cache.data,
                meta.slot_mapping, meta.block_table, meta.context_lens, *self._heads,
                first_layer, first_part, parts)

        if model.tp.world_size() == 1:
            x = run(x, self._all, 0, 0, 2 * len(self._each))
        else:  # each part's output summed over the ranks before the next part reads it
            for layer, lists in enumerate(self._each):
                for part in (0, 1):
                    x = model.tp.all_reduce(run(x, lists, layer, part, 1))
        x, _ = self.head.norm(x, residual)
        # the LM head KERNEL_ROWS rows at a time, as a quantized model's int8 C++ kernel takes
        # them (more rows would take torch's kernel, whose other roundings would make a row's
        # token depend on how many sequences share its step; a float model's LM head is the
        # picked product of its row count)
        return torch.cat([self.head.lm_head.local(x[i:i + KERNEL_ROWS])
                          for i in range(0, len(x), KERNEL_ROWS)])
