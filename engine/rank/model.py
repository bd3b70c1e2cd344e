"""The decoder-only transformer (Llama, Mistral, SmolLM2, Qwen2), written once against the
tensor-parallel layers: with one rank it holds the whole model, with N it holds its shard.

Every op is a module of its own, so the model reads as the math and anything that observes it
(tracing, the walkthrough) hooks in from outside.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.loading.model_config import ModelConfig
from engine.plan import ShardPlan
from engine.rank.attention import KVStore, PagedAttention
from engine.rank.backend import TORCH, Backend
from engine.rank.overlap import run_halves_interleaved
from engine.rank.rotary import RotaryEmbedding
from engine.rank.step_context import StepContext
from parallel.comm import TensorGroup
from parallel.layers import (ColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                             RowParallelLinear, TensorReader, VocabParallelEmbedding,
                             copy_checked)
from parallel.partition import range_times


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, backend: Backend):
        super().__init__()
        self.eps, self.backend = eps, backend
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """(normed x + residual, x + residual): the sum is the next residual."""
        return self.backend.rmsnorm(x, residual, self.weight, self.eps)

    def load(self, read: TensorReader, name: str) -> None:
        copy_checked(self.weight, read(f"{name}.weight", None, 0, 0), f"{name}.weight")


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: ShardPlan, layer_idx: int,
                 rotary_emb: RotaryEmbedding, backend: Backend, tp: TensorGroup):
        super().__init__()
        self.head_dim = hd = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, hd, shard.heads, cfg.qkv_bias,
                                          backend.linear)
        self.rotary_emb = rotary_emb
        self.kv_store = KVStore(layer_idx)
        self.attn = PagedAttention(layer_idx, hd ** -0.5)
        self.o_proj = RowParallelLinear(range_times(shard.heads.q_heads, hd), cfg.hidden_size, tp,
                                        matmul=backend.linear)

    def forward(self, x: torch.Tensor, ctx: StepContext, async_op: bool = False,
                rows: torch.Tensor | None = None):
        """[T, hidden] summed over ranks (or, `async_op`, that sum in flight); `rows`: only
        those rows' output goes through o_proj (every row's K/V is stored all the same)."""
        q, k, v = (t.view(len(x), -1, self.head_dim) for t in self.qkv_proj.split(self.qkv_proj(x)))
        q, k = self.rotary_emb(ctx.positions, q, k)
        self.kv_store(k, v, ctx)
        out = self.attn(q, k, v, ctx).flatten(1)
        return self.o_proj(out if rows is None else out[rows], async_op=async_op)

    def load(self, read: TensorReader, prefix: str) -> None:
        self.qkv_proj.load(read, [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"])
        self.o_proj.load(read, f"{prefix}.o_proj")


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: ShardPlan, backend: Backend, tp: TensorGroup):
        super().__init__()
        # SiLU(gate) · up comes out of the gate/up projection itself: a prompt's product can
        # apply it as the product's tiles are written (engine.rank.gemm.gated_halves)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [shard.ffn, shard.ffn],
                                                 matmul=backend.gated())
        self.down_proj = RowParallelLinear(shard.ffn, cfg.hidden_size, tp, matmul=backend.linear)

    def forward(self, x: torch.Tensor, async_op: bool = False):
        return self.down_proj(self.gate_up_proj(x), async_op=async_op)

    def load(self, read: TensorReader, prefix: str) -> None:
        self.gate_up_proj.load(read, [f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.down_proj.load(read, f"{prefix}.down_proj")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: ShardPlan, layer_idx: int,
                 rotary_emb: RotaryEmbedding, backend: Backend, tp: TensorGroup):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.self_attn = Attention(cfg, shard, layer_idx, rotary_emb, backend, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.mlp = MLP(cfg, shard, backend, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.attention_part(x, residual, ctx)
        return self.mlp_part(x, residual)

    def attention_part(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext,
                       async_op: bool = False, rows: torch.Tensor | None = None):
        """Norm, attention, o_proj: (its output or, `async_op`, its all-reduce in flight,
        the residual); `rows`: those rows' only, of both."""
        x, residual = self.input_layernorm(x, residual)
        out = self.self_attn(x, ctx, async_op, rows)
        return out, residual if rows is None else residual[rows]

    def mlp_part(self, x: torch.Tensor, residual: torch.Tensor, async_op: bool = False):
        """Norm, gate/up, SiLU·mul, down: (its output or its all-reduce in flight, residual)."""
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, async_op), residual

    def load(self, read: TensorReader, prefix: str) -> None:
        self.input_layernorm.load(read, f"{prefix}.input_layernorm")
        self.self_attn.load(read, f"{prefix}.self_attn")
        self.post_attention_layernorm.load(read, f"{prefix}.post_attention_layernorm")
        self.mlp.load(read, f"{prefix}.mlp")


def last_layer(layer: DecoderLayer, x: torch.Tensor, residual: torch.Tensor | None,
               ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
    """The last layer, its o_proj and MLP over ctx.last_layer_rows only where the step sets
    them: the output of (hidden, residual) has those rows, in their order."""
    rows = ctx.last_layer_rows
    if rows is None:
        return layer(x, residual, ctx)
    return layer.mlp_part(*layer.attention_part(x, residual, ctx, rows=rows))


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: ShardPlan, max_positions: int,
                 backend: Backend = TORCH, tp: TensorGroup | None = None):
        """`tp`: the rank's tensor-parallel group, which every sharded layer sums over (None:
        a world of one, or the whole process group)."""
        super().__init__()
        self.tp = tp = tp or TensorGroup()
        rotary_emb = RotaryEmbedding(cfg, max_positions, backend)
        self.embed_tokens = VocabParallelEmbedding(shard.vocab, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, shard, i, rotary_emb, backend, tp)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.lm_head = ParallelLMHead(shard.vocab_ranges, shard.rank, cfg.hidden_size, tp,
                                      self.embed_tokens if cfg.tie_word_embeddings else None,
                                      backend.linear)

    def forward(self, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's last-layer output and residual [T, d], before the final norm (scoring
        reads them all; sampling only a few), or those of ctx.last_layer_rows where set. Not
        in inference mode itself: inductor cannot write the KV cache (an input of the graph) in
        a graph traced in inference mode, so the runner enters it around the eager call."""
        x = self.embed_tokens(ctx.token_ids)
        if ctx.halves is not None:  # overlap_comm: two micro-batches, interleaved
            return run_halves_interleaved(self.layers, x, ctx.halves)
        residual = None
        for layer in self.layers[:-1]:
            x, residual = layer(x, residual, ctx)
        return last_layer(self.layers[-1], x, residual, ctx)

    @torch.inference_mode()
    def logits(self, x: torch.Tensor, residual: torch.Tensor,
               logits_indices: torch.Tensor) -> torch.Tensor | None:
        # only the rows that sample a token go through the final norm and the LM head
        if not len(logits_indices):  # every rank sees the same batch, so all skip together
            return None
        x, _ = self.norm(x[logits_indices], residual[logits_indices])
        logits = self.lm_head(x)
        return None if logits is None else logits.float()

    def load(self, read: TensorReader) -> None:
        self.embed_tokens.load(read, "model.embed_tokens")
        for i, layer in enumerate(self.layers):
            layer.load(read, f"model.layers.{i}")
        self.norm.load(read, "model.norm")
        self.lm_head.load(read, "lm_head")
