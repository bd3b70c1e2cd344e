"""FLOPs of a forward pass, counted from the model's shape (a multiply-add is 2 FLOPs)."""
from __future__ import annotations

from engine.model_config import ModelConfig


def attention_pairs(q_len: int, kv_len: int) -> int:
    """Query-key pairs a causal attention scores when q_len new tokens end a kv_len context."""
    prefix = kv_len - q_len
    return q_len * prefix + q_len * (q_len + 1) // 2


def forward_flops(cfg: ModelConfig, q_len: int, kv_len: int, logits_rows: int = 1) -> int:
    """One sequence: q_len new tokens over a context of kv_len, logits for logits_rows rows."""
    d, hd = cfg.hidden_size, cfg.head_dim
    q_width, kv_width = cfg.num_heads * hd, cfg.num_kv_heads * hd
    linear = d * (q_width + 2 * kv_width) + q_width * d + 3 * d * cfg.intermediate_size
    per_layer = 2 * q_len * linear + 2 * 2 * cfg.num_heads * hd * attention_pairs(q_len, kv_len)
    return cfg.num_layers * per_layer + 2 * logits_rows * d * cfg.vocab_size
