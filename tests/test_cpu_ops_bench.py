"""bench.cpu_ops's compiled flex attention: the candidate it times must compute the attention
it stands beside."""
from __future__ import annotations

import math

import pytest
import torch

from bench.cpu_ops import _flex_attention


def _plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [1, hq, q_len, d] at the last q_len positions of k/v [1, hkv, kv_len, d], each KV head
    shared by hq / hkv consecutive query heads: softmax(q kᵀ / √d) v, by the formula."""
    q_len, kv_len, group = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1).double() for x in (k, v))
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    seen = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
    return (scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v).float()


@pytest.mark.parametrize("q_len,kv_len", [(24, 24), (8, 40)])
def test_flex_attention_matches_the_formula(q_len, kv_len):
    torch.manual_seed(0)
    q = torch.randn(1, 9, q_len, 64)
    k, v = torch.randn(1, 3, kv_len, 64), torch.randn(1, 3, kv_len, 64)
    out = _flex_attention(q, k, v)()
    assert out.shape == q.shape
    torch.testing.assert_close(out, _plain_attention(q, k, v), atol=1e-5, rtol=1e-5)

