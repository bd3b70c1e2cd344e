"""Independent references: Hugging Face `transformers` running the same weights."""
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
