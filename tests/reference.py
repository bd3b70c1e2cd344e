"""Independent references: Hugging Face `transformers` running the same weights, and plain float64
formulas."""
from __future__ import annotations

import torch

from launcher.baseline import hf_model  # noqa: F401  (re-exported for the tests)


@torch.inference_mode()
def hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1].float()


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """n argmax tokens with HF's own KV cache, never stopping at EOS."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = []
    for _ in range(n):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


@torch.inference_mode()
def hf_kv(model, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) after prefill, as [T, kv_heads, head_dim]."""
    cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    out = []
    for layer in cache.layers:
        out.append((layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)))
    return out


def causal_attention_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """softmax(q kᵀ) v in float64 with an explicit causal mask: query j of q [Tq, hq, d] sits at
    position len(k) - len(q) + j and sees keys up to it; query head h reads KV head
    h // (hq / hkv) of k, v [Tk, hkv, d]."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = (x.double().transpose(0, 1) for x in (q, k, v))
    kd, vd = kd.repeat_interleave(group, 0), vd.repeat_interleave(group, 0)
    scores = qd @ kd.transpose(1, 2) * scale
    pos = torch.arange(len(k) - len(q), len(k))
    scores = scores.masked_fill(torch.arange(len(k))[None, :] > pos[:, None], float("-inf"))
    return (scores.softmax(-1) @ vd).transpose(0, 1)
