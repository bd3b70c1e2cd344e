"""Next-token choice from last-position logits: greedy, temperature, top-k, top-p."""
from __future__ import annotations

import torch

from engine.batch import SamplingSpec


def _filtered(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token once the tokens before it already reach top_p; the top token always stays
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample(logits: torch.Tensor, specs: list[SamplingSpec]) -> list[int]:
    """logits: [n, vocab] float32, one row per spec."""
    out = []
    for row, spec in zip(logits, specs):
        if spec.temperature == 0.0:
            out.append(int(row.argmax()))
            continue
        probs = _filtered(row / spec.temperature, spec.top_k, spec.top_p).softmax(-1)
        gen = None
        if spec.seed is not None:
            # seeded by (request seed, step): the same draw at TP=1 and TP=N, in any batch
            gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + spec.step)
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
