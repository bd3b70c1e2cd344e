"""Next-token choice from last-position logits: greedy, temperature, top-k, top-p."""
from __future__ import annotations

import hashlib
import time

import numpy as np
import torch
from torch import nn

from engine.batch import Batch, SamplingSpec, StepResult


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


def _argmax(row: torch.Tensor) -> int:
    """The index of the row's largest value (its first, where several are): numpy's on a host
    float32 row, which is vectorised (5 us for SmolLM2's 49152 logits on the AVX512-BF16 EPYC,
    torch's argmax 44 us: ~0.8 % of a 4-bit decode step)."""
    if row.dtype == torch.float32 and row.device.type == "cpu" and not row.requires_grad:
        return int(row.numpy().argmax())
    return int(row.argmax())


def sample(logits: torch.Tensor, specs: list[SamplingSpec]) -> list[int]:
    """logits: [n, vocab] float32, one row per spec."""
    out = []
    for row, spec in zip(logits, specs):
        if spec.temperature == 0.0:
            out.append(_argmax(row))
            continue
        scaled = _scaled(row, spec.temperature)
        if scaled is None:
            out.append(_argmax(row))
            continue
        probs = _filtered(scaled, spec.top_k, spec.top_p).softmax(-1)
        gen = None
        if spec.seed is not None:
            gen = torch.Generator().manual_seed(generator_seed(spec.seed, spec.step))
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out


class Sampler(nn.Module):
    """The next token of every row; a module so the tracer sees it as an op."""

    def forward(self, logits: torch.Tensor, specs: list[SamplingSpec]) -> list[int]:
        return sample(logits, specs)


def sample_into(sampler: Sampler, logits: torch.Tensor, batch: Batch, result: StepResult) -> None:
    """Fill `result` with one token per row of `logits` (host float32). A row of NaN/Inf would
    "sample" garbage: it is flagged and sampled from a safe stand-in, and a row whose settings
    make sampling raise fails alone, so one bad request spares the others."""
    start = time.perf_counter()
    # a row is finite iff its largest and smallest values are (numpy's max and min keep a NaN):
    # 9 us for a 49152-token row on the AVX512-BF16 EPYC, against 24 for torch's largest
    # magnitude (abs, then amax) and more for isfinite(logits).all()
    rows = logits.numpy()
    result.nonfinite_rows = np.flatnonzero(
        ~(np.isfinite(rows.max(-1)) & np.isfinite(rows.min(-1)))).tolist()
    safe = logits.nan_to_num(0.0, 0.0, 0.0) if result.nonfinite_rows else logits
    try:
        result.token_ids = sampler(safe, batch.sampling)
    except Exception:  # noqa: BLE001  one request's settings: find it, spare the others
        result.token_ids = [_sample_row(safe, i, spec, result)
                            for i, spec in enumerate(batch.sampling)]
    result.logits = logits if batch.return_logits else None
    result.sample_s = time.perf_counter() - start


def _sample_row(logits: torch.Tensor, row: int, spec: SamplingSpec, result: StepResult) -> int:
    try:
        return sample(logits[row:row + 1], [spec])[0]
    except Exception as e:  # noqa: BLE001  reported to the driver as this request's failure
        result.row_errors[row] = f"{type(e).__name__}: {e}"
        return 0
