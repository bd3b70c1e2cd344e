"""engine.rank.blocked_attention against a float64 softmax(QKᵀ)V with an explicit causal mask:
whole prompts, chunks after a cached prefix, grouped and ungrouped heads, lengths that are not
multiples of the block."""
from __future__ import annotations

import pytest
import torch

from engine.rank.blocked_attention import blocked_causal_attention
from tests.cpu_features import needs_onednn_bf16
from tests.reference import causal_attention_float64


@pytest.mark.parametrize("q_len,kv_len", [(2, 2), (37, 37), (300, 300), (5, 41), (130, 400)])
@pytest.mark.parametrize("heads,kv_heads", [(6, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float32, 1e-5)])
def test_matches_float64(q_len, kv_len, heads, kv_heads, dtype, tol):
    gen = torch.Generator().manual_seed(q_len * 1000 + kv_len)
    q = torch.randn(q_len, heads, 32, generator=gen).to(dtype)
    k, v = (torch.randn(kv_len, kv_heads, 32, generator=gen).to(dtype) for _ in range(2))
    out = blocked_causal_attention(q, k, v, 32 ** -0.5, block=64)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), causal_attention_float64(q, k, v, 32 ** -0.5), atol=tol, rtol=0)


@needs_onednn_bf16
def test_engine_bf16_prefill_uses_it_and_matches_fp32(tiny_model_dir, monkeypatch):
    """A bf16 engine's prompt logits stay within bf16 error of the float32 engine's, whole and
    after a prefix hit (the chunk attends over cached keys); only the bf16 engine's prompt
    steps go through the blocked attention (a spy on the in-process rank counts them) under the
    built-in choice (kernel_choice="fixed"; tests/test_kernel_choice.py covers the timed one)."""
    from engine import LLM
    from engine.loading.synthetic import random_token_ids
    from engine.rank import attention

    calls = []
    real = attention.blocked_causal_attention
    monkeypatch.setattr(attention, "blocked_causal_attention",
                        lambda q, *args: calls.append((q.dtype, len(q))) or real(q, *args))

    path = str(tiny_model_dir("qwen2"))
    prompts = [random_token_ids(70, 300, seed=1), random_token_ids(70, 300, seed=1) + [5, 6, 7]]
    logits, cached = {}, 0
    for dtype in ("float32", "bfloat16"):
        with LLM(path, dtype=dtype, kernel_choice="fixed") as llm:
            outs = [llm.prefill([p])[0] for p in prompts]
        logits[dtype], cached = [o.logits for o in outs], outs[1].cached_tokens
    layers = len(calls) // 2
    assert cached == 64 and layers > 0  # the second prompt reuses 4 blocks of 16
    assert calls == [(torch.bfloat16, 70)] * layers + [(torch.bfloat16, 73 - 64)] * layers
    for fp32, bf16 in zip(logits["float32"], logits["bfloat16"]):
        assert (fp32 - bf16).abs().max().item() < 0.05 * fp32.abs().max().item()
