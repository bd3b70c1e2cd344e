"""The decoder-only transformer (Llama, Mistral, SmolLM2, Qwen2), written once against the
tensor-parallel layers: with one rank it holds the whole model, with N it holds its shard."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.observe import costs
from engine.rank.attention import AttentionMetadata
from engine.rank.backend import TORCH, Backend
from engine.rank.kv_cache import KVCache
from engine.loading.model_config import ModelConfig
from engine.rank.rope import RotaryEmbedding
from parallel.layers import (ColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                             RowParallelLinear, TensorReader, VocabParallelEmbedding,
                             copy_checked)
from parallel.partition import HeadPartition, Range, even_ranges, partition_heads, scale
from parallel.trace import TRACER


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """What one rank owns of every layer."""

    rank: int
    world_size: int
    heads: HeadPartition
    ffn: Range
    vocab_ranges: list[Range]

    @classmethod
    def for_rank(cls, cfg: ModelConfig, rank: int, world_size: int) -> "ShardPlan":
        return cls(rank, world_size, partition_heads(cfg.num_heads, cfg.num_kv_heads, world_size)[rank],
                   even_ranges(cfg.intermediate_size, world_size)[rank],
                   even_ranges(cfg.vocab_size, world_size))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, backend: Backend, trace_name: str):
        super().__init__()
        self.eps, self.backend, self.trace_name = eps, backend, trace_name
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """(normed x + residual, x + residual): the sum is the next residual."""
        with TRACER.op(self.trace_name, lambda: costs.rmsnorm(x, residual, self.weight), x.device):
            return self.backend.rmsnorm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: ShardPlan, rope: RotaryEmbedding, backend: Backend):
        super().__init__()
        hd = cfg.head_dim
        self.head_dim, self.scale, self.rope, self.backend = hd, hd ** -0.5, rope, backend
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, hd, plan.heads, cfg.qkv_bias)
        self.o_proj = RowParallelLinear(scale(plan.heads.q_heads, hd), cfg.hidden_size,
                                        trace_name="o_proj")

    def forward(self, layer: int, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(len(x), -1, self.head_dim)
        k = k.view(len(x), -1, self.head_dim)
        v = v.view(len(x), -1, self.head_dim)
        with TRACER.op("rope", lambda: costs.rope(q, k), x.device):
            q, k = self.backend.rope(positions, q, k, self.rope.cos, self.rope.sin)
        with TRACER.op("kv_write", lambda: costs.kv_write(k, v), x.device):
            self.backend.kv_store(cache, layer, k, v, meta.slot_mapping)
        with TRACER.op("attention", lambda: costs.attention(q, k, meta), x.device):
            o = self.backend.attention(layer, q, k, v, cache, meta, self.scale)
        return self.o_proj(o.flatten(1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: ShardPlan, backend: Backend):
        super().__init__()
        self.backend = backend
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [plan.ffn, plan.ffn],
                                                 trace_name="gate_up_proj")
        self.down_proj = RowParallelLinear(plan.ffn, cfg.hidden_size, trace_name="down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        with TRACER.op("silu_mul", lambda: costs.silu_mul(gate_up), x.device):
            act = self.backend.silu_mul(gate_up)
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: ShardPlan, rope: RotaryEmbedding, backend: Backend):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend, "input_norm")
        self.self_attn = Attention(cfg, plan, rope, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend,
                                                "post_attn_norm")
        self.mlp = MLP(cfg, plan, backend)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: ShardPlan, max_positions: int,
                 backend: Backend = TORCH):
        super().__init__()
        self.cfg, self.plan = cfg, plan
        rope = RotaryEmbedding(cfg, max_positions)
        self.embed_tokens = VocabParallelEmbedding(plan.vocab_ranges[plan.rank], cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, plan, rope, backend)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend, "final_norm")
        self.lm_head = ParallelLMHead(plan.vocab_ranges, plan.rank, cfg.hidden_size,
                                      self.embed_tokens if cfg.tie_word_embeddings else None)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor | None:
        """Logits [len(logits_indices), vocab] on rank 0 (None on other ranks)."""
        h, residual = self.hidden_states(token_ids, positions, cache, meta)
        return self.logits(h, residual, logits_indices)

    @torch.inference_mode()
    def hidden_states(self, token_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's last-layer output and residual [T, d], before the final norm (scoring
        reads them all; sampling only a few)."""
        h, residual = self.embed_tokens(token_ids), None
        for i, layer in enumerate(self.layers):
            TRACER.layer = i
            x, residual = layer.input_layernorm(h, residual)
            h = layer.self_attn(i, x, positions, cache, meta)
            x, residual = layer.post_attention_layernorm(h, residual)
            h = layer.mlp(x)
        TRACER.layer = -1
        return h, residual

    @torch.inference_mode()
    def logits(self, h: torch.Tensor, residual: torch.Tensor,
               logits_indices: torch.Tensor) -> torch.Tensor | None:
        # only the rows that sample a token go through the final norm and the LM head
        if not len(logits_indices):  # every rank sees the same batch, so all skip together
            return None
        last = self.norm(h[logits_indices], residual[logits_indices])[0]
        logits = self.lm_head(last)
        return None if logits is None else logits.float()

    def load(self, read: TensorReader) -> None:
        self.embed_tokens.load(read, "model.embed_tokens")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}"
            _load_norm(layer.input_layernorm, read, f"{p}.input_layernorm")
            _load_norm(layer.post_attention_layernorm, read, f"{p}.post_attention_layernorm")
            attn = f"{p}.self_attn"
            layer.self_attn.qkv_proj.load(read, [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"])
            layer.self_attn.o_proj.load(read, f"{attn}.o_proj")
            layer.mlp.gate_up_proj.load(read, [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"])
            layer.mlp.down_proj.load(read, f"{p}.mlp.down_proj")
        _load_norm(self.norm, read, "model.norm")
        self.lm_head.load(read, "lm_head")


def _load_norm(norm: RMSNorm, read: TensorReader, name: str) -> None:
    copy_checked(norm.weight, read(f"{name}.weight", None, 0, 0), f"{name}.weight")
