"""Scoring requests on the driver: which rows of a step are scored, and where their results go.

A scored prompt of T tokens has T-1 log-probabilities: position p (0 <= p < T-1) scores token
p+1. It runs like a prefill that never samples, chunked like any prompt; each chunk's results
are stored by position, so a chunk that is recomputed (after preemption or a retry) overwrites
rather than appends.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.batch import Batch
from engine.driver.outputs import ScoreOutput
from engine.errors import InvalidRequestError


@dataclass(slots=True)
class ScoreRequest:
    top_k: int
    num_tokens: int
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    peak_logits_bytes: int = 0

    def __post_init__(self):
        self.logprobs = [math.nan] * (self.num_tokens - 1)
        self.top = [[] for _ in range(self.num_tokens - 1)] if self.top_k else []


def check_top_logprobs(top_logprobs, vocab_size: int) -> int:
    # bool is an int subclass, but True as "1 candidate" is surely a mistake
    if type(top_logprobs) is not int or top_logprobs < 0:
        raise InvalidRequestError(f"top_logprobs={top_logprobs!r}: use a non-negative int "
                                  f"(0 for none)")
    if top_logprobs > vocab_size:
        raise InvalidRequestError(f"top_logprobs={top_logprobs} exceeds the vocabulary of "
                                  f"{vocab_size} tokens; use at most {vocab_size}")
    return top_logprobs


def check_scorable(token_lists: list[list[int]]) -> None:
    """A prompt needs two tokens to score one; reject the call before anything is queued."""
    for i, ids in enumerate(token_lists):
        if len(ids) < 2:
            raise InvalidRequestError(
                f"prompt {i} has {len(ids)} token(s) ({ids}); scoring needs at least 2, since "
                f"the first token has no log-probability: prepend a BOS token or more text")


def add_score_rows(batch: Batch, seq, start: int, end: int) -> None:
    """The rows of positions start..end-1 (just appended to `batch`) that have a next token."""
    first_row = batch.cu_seqlens_q[-1] - (end - start)
    for p in range(start, min(end, seq.num_prompt_tokens - 1)):
        batch.score_indices.append(first_row + p - start)
        batch.score_targets.append(seq.token_ids[p + 1])
    batch.score_top_k = max(batch.score_top_k, seq.score.top_k)


def take_score_rows(seq, start: int, end: int, rows, cursor: int) -> int:
    """Store the results of positions start..end-1 from `rows` (a LogprobRows) beginning at
    row `cursor`; returns the next unread row."""
    req: ScoreRequest = seq.score
    stop = min(end, seq.num_prompt_tokens - 1)
    n = max(0, stop - start)
    if n == 0:
        return cursor
    req.logprobs[start:stop] = rows.logprobs[cursor:cursor + n].tolist()
    if req.top_k:
        ids = rows.top_ids[cursor:cursor + n, :req.top_k].tolist()
        lps = rows.top_logprobs[cursor:cursor + n, :req.top_k].tolist()
        req.top[start:stop] = [list(zip(i, v)) for i, v in zip(ids, lps)]
    req.peak_logits_bytes = max(req.peak_logits_bytes, rows.peak_logits_bytes)
    return cursor + n


def is_finite(seq) -> bool:
    return all(math.isfinite(v) or v == -math.inf for v in seq.score.logprobs)


def score_output(seq) -> ScoreOutput:
    req: ScoreRequest = seq.score
    nll = -math.fsum(req.logprobs) / len(req.logprobs)
    perplexity = math.exp(nll) if nll < 700 else math.inf  # a -inf logprob: infinitely surprised
    return ScoreOutput(list(seq.prompt_token_ids), list(req.logprobs), perplexity,
                       req.top if req.top_k else None, req.peak_logits_bytes)
