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
from engine.rank.attention import KVStore, PagedAttention, StepContext
from engine.rank.backend import TORCH, Backend
from engine.rank.overlap import SplitContext, run_layers_split
from engine.rank.rotary import RotaryEmbedding
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


class SiluAndMul(nn.Module):
    def __init__(self, backend: Backend):
        super().__init__()
        self.backend = backend

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.backend.silu_mul(gate_up)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: ShardPlan, layer_idx: int,
                 rotary_emb: RotaryEmbedding, backend: Backend):
        super().__init__()
        self.head_dim = hd = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, hd, shard.heads, cfg.qkv_bias)
        self.rotary_emb = rotary_emb
        self.kv_store = KVStore(layer_idx, backend)
        self.attn = PagedAttention(layer_idx, hd ** -0.5, backend)
        self.o_proj = RowParallelLinear(range_times(shard.heads.q_heads, hd), cfg.hidden_size)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.o_proj(self.attend(positions, x, ctx))

    def attend(self, positions: torch.Tensor, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Everything before o_proj (and its all-reduce): [T, local q heads * head_dim]."""
        q, k, v = (t.view(len(x), -1, self.head_dim) for t in self.qkv_proj.split(self.qkv_proj(x)))
        q, k = self.rotary_emb(positions, q, k)
        self.kv_store(k, v, ctx)
        return self.attn(q, k, v, ctx).flatten(1)

    def load(self, read: TensorReader, prefix: str) -> None:
        self.qkv_proj.load(read, [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"])
        self.o_proj.load(read, f"{prefix}.o_proj")


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: ShardPlan, backend: Backend):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [shard.ffn, shard.ffn])
        self.act_fn = SiluAndMul(backend)
        self.down_proj = RowParallelLinear(shard.ffn, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))

    def load(self, read: TensorReader, prefix: str) -> None:
        self.gate_up_proj.load(read, [f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.down_proj.load(read, f"{prefix}.down_proj")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: ShardPlan, layer_idx: int,
                 rotary_emb: RotaryEmbedding, backend: Backend):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.self_attn = Attention(cfg, shard, layer_idx, rotary_emb, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.mlp = MLP(cfg, shard, backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def load(self, read: TensorReader, prefix: str) -> None:
        self.input_layernorm.load(read, f"{prefix}.input_layernorm")
        self.self_attn.load(read, f"{prefix}.self_attn")
        self.post_attention_layernorm.load(read, f"{prefix}.post_attention_layernorm")
        self.mlp.load(read, f"{prefix}.mlp")


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: ShardPlan, max_positions: int,
                 backend: Backend = TORCH):
        super().__init__()
        rotary_emb = RotaryEmbedding(cfg, max_positions, backend)
        self.embed_tokens = VocabParallelEmbedding(shard.vocab, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, shard, i, rotary_emb, backend)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.lm_head = ParallelLMHead(shard.vocab_ranges, shard.rank, cfg.hidden_size,
                                      self.embed_tokens if cfg.tie_word_embeddings else None)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext,
                logits_indices: torch.Tensor) -> torch.Tensor | None:
        """Logits [len(logits_indices), vocab] on rank 0 (None on other ranks)."""
        x, residual = self.hidden_states(token_ids, positions, ctx)
        return self.logits(x, residual, logits_indices)

    @torch.inference_mode()
    def hidden_states(self, token_ids: torch.Tensor, positions: torch.Tensor,
                      ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's last-layer output and residual [T, d], before the final norm (scoring
        reads them all; sampling only a few)."""
        return self.run_layers(token_ids, positions, ctx)

    def run_layers(self, token_ids: torch.Tensor, positions: torch.Tensor,
                   ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states outside inference mode, for the compiled decode graph: inductor cannot
        write the KV cache (an input of the graph) in a graph traced in inference mode."""
        if isinstance(ctx, SplitContext):  # overlap_comm: two micro-batches, interleaved
            return run_layers_split(self, token_ids, positions, ctx)
        x, residual = self.embed_tokens(token_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        return x, residual

    @torch.inference_mode()
    def logits(self, x: torch.Tensor, residual: torch.Tensor,
               logits_indices: torch.Tensor) -> torch.Tensor | None:
        # only the rows that sample a token go through the final norm and the LM head
        if not len(logits_indices):  # every rank sees the same batch, so all skip together
            return None
        x, _ = self.norm(x[logits_indices], residual[logits_indices])
        logits = self.lm_head(x)
        return None if logits is None else logits.float()

    def local_logits(self, token_ids: torch.Tensor, positions: torch.Tensor,
                     ctx) -> torch.Tensor:
        """Every row's logits for this rank's vocabulary slice, before the gather: the compiled
        decode graph, where each row is a sequence's newest token and every row samples (run
        under no_grad, see run_layers)."""
        x, residual = self.run_layers(token_ids, positions, ctx)
        x, _ = self.norm(x, residual)
        return self.lm_head.local(x)

    def load(self, read: TensorReader) -> None:
        self.embed_tokens.load(read, "model.embed_tokens")
        for i, layer in enumerate(self.layers):
            layer.load(read, f"model.layers.{i}")
        self.norm.load(read, "model.norm")
        self.lm_head.load(read, "lm_head")
