"""What each op of the forward costs: FLOPs (a multiply-add is 2) and bytes read + written.

Per-op functions take the op's real tensors and return (shapes, FLOPs, bytes) for the tracer.
Element-wise ops count FLOPs per output element: RMSNorm 4 (square, sum, scale, weight) plus 1
for a fused residual add; RoPE 3 (two products and a sum per rotated element); SiLU·mul 4
(negate, exp, divide, multiply). Attention counts the query-key pairs it scores: causal, so a
prompt of T tokens scores T(T+1)/2 pairs per head, each 2·d FLOPs for QKᵀ and 2·d for PV.
"""
from __future__ import annotations

import torch

from engine.loading.model_config import ModelConfig
from parallel.trace import nbytes, shape


def attention_pairs(q_len: int, kv_len: int) -> int:
    """Query-key pairs a causal attention scores when q_len new tokens end a kv_len context."""
    prefix = kv_len - q_len
    return q_len * prefix + q_len * (q_len + 1) // 2


def forward_flops(cfg: ModelConfig, q_len: int, kv_len: int, logits_rows: int = 1) -> int:
    """Matmul and attention FLOPs of one sequence: q_len new tokens over a context of kv_len,
    logits for logits_rows rows (element-wise ops are left out: they are < 1% of a layer)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    q_width, kv_width = cfg.num_heads * hd, cfg.num_kv_heads * hd
    linear = d * (q_width + 2 * kv_width) + q_width * d + 3 * d * cfg.intermediate_size
    per_layer = 2 * q_len * linear + 2 * 2 * cfg.num_heads * hd * attention_pairs(q_len, kv_len)
    return cfg.num_layers * per_layer + 2 * logits_rows * d * cfg.vocab_size


def rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor):
    n = x.numel()
    if residual is None:  # read x and the weight, write the normed rows
        return shape(x), 4 * n, 2 * nbytes(x) + nbytes(weight)
    # also read the residual and write the new one (x + residual)
    return f"{shape(x)} + residual", 5 * n, 4 * nbytes(x) + nbytes(weight)


def rope(q: torch.Tensor, k: torch.Tensor):
    """Read and write q and k, and read a cos and a sin row (float32, d/2 wide) per token."""
    tables = 2 * len(q) * (q.shape[-1] // 2) * 4
    return f"q {shape(q)}, k {shape(k)}", 3 * (q.numel() + k.numel()), 2 * nbytes(q, k) + tables


def kv_write(k: torch.Tensor, v: torch.Tensor):
    """Read the new K/V, write them into their cache slots: pure data movement."""
    return f"k, v {shape(k)} -> cache", 0, 2 * nbytes(k, v)


def attention(q: torch.Tensor, k: torch.Tensor, meta) -> tuple[str, int, int]:
    """Read the queries and each sequence's whole K/V context, write the outputs."""
    heads, d = q.shape[1], q.shape[2]
    cu = meta.cu_seqlens_q
    pairs = sum(attention_pairs(cu[i + 1] - cu[i], n) for i, n in enumerate(meta.context_lens))
    kv_bytes = 2 * sum(meta.context_lens) * k.shape[1] * d * k.element_size()
    return (f"q {shape(q)} over kv [{sum(meta.context_lens)}, {k.shape[1]}, {d}]",
            4 * heads * d * pairs, 2 * nbytes(q) + kv_bytes)


def silu_mul(gate_up: torch.Tensor):
    half = gate_up.numel() // 2
    return f"{shape(gate_up)} -> [{len(gate_up)}, {gate_up.shape[-1] // 2}]", 4 * half, \
        nbytes(gate_up) + half * gate_up.element_size()


def sample(logits: torch.Tensor):
    """One comparison per vocabulary entry (argmax; softmax and filters for sampling)."""
    return shape(logits), logits.numel(), nbytes(logits)
