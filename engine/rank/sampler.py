"""Next-token choice from last-position logits: greedy, temperature, top-k, top-p."""
from __future__ import annotations

import hashlib

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


def generator_seed(seed: int, step: int) -> int:
    """A torch seed from (request seed, step), for seeds of any size: a hash of both reduced to
    63 bits, so it never overflows manual_seed and depends on nothing but the two numbers (the
    same draw at TP=1 and TP=N, in any batch)."""
    # step in a fixed 8 bytes, then the seed's own bytes: no two pairs share an input
    seed_bytes = seed.to_bytes(seed.bit_length() // 8 + 1, "little", signed=True)
    data = step.to_bytes(8, "little") + seed_bytes
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


def _scaled(row: torch.Tensor, temperature: float) -> torch.Tensor | None:
    """row / temperature, or None where that overflows (huge logits at a tiny temperature):
    the draw is then the argmax, the limit of sampling as the temperature goes to 0."""
    scaled = row / temperature
    return scaled if bool(torch.isfinite(scaled).all()) else None


def sample(logits: torch.Tensor, specs: list[SamplingSpec]) -> list[int]:
    """logits: [n, vocab] float32, one row per spec."""
    out = []
    for row, spec in zip(logits, specs):
        if spec.temperature == 0.0:
            out.append(int(row.argmax()))
            continue
        scaled = _scaled(row, spec.temperature)
        if scaled is None:
            out.append(int(row.argmax()))
            continue
        probs = _filtered(scaled, spec.top_k, spec.top_p).softmax(-1)
        gen = None
        if spec.seed is not None:
            gen = torch.Generator().manual_seed(generator_seed(spec.seed, spec.step))
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
