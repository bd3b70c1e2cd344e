"""The one flat description of a step that the driver sends to every rank."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SamplingSpec:
    """What the sampler needs for one sequence at one step. `step` counts the tokens this
    sequence has sampled before, so a seeded request draws the same tokens wherever it runs."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    step: int = 0


@dataclass(slots=True)
class Batch:
    """New tokens of every scheduled sequence, packed with no padding.

    Sequence i owns flat rows cu_seqlens_q[i]:cu_seqlens_q[i+1]; after this step its KV length
    is context_lens[i]. slot_mapping[t] is the paged-cache slot (block * block_size + offset)
    that token t's K/V go to (-1 with context parallelism, whose ranks place them: cp_layout).
    logits_indices are the rows whose next token is sampled.
    """

    token_ids: list[int]
    positions: list[int]
    cu_seqlens_q: list[int]
    context_lens: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]
    logits_indices: list[int]
    sampling: list[SamplingSpec] = field(default_factory=list)
    return_logits: bool = False
    # scoring: rows whose next-token log-probability is wanted, those next tokens, and how many
    # top candidates to return per row (0: none). Such rows never sample.
    score_indices: list[int] = field(default_factory=list)
    score_targets: list[int] = field(default_factory=list)
    score_top_k: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


@dataclass(slots=True)
class StepResult:
    """What rank 0 sends back: one sampled token per logits index, and the logits if asked."""

    token_ids: list[int]
    logits: torch.Tensor | None = None
    forward_s: float = 0.0  # rank 0's time in the forward pass
    collective_s: float = 0.0  # of which inside all-reduce / gather
    sample_s: float = 0.0  # rank 0's time choosing the tokens
    nonfinite_rows: list[int] = field(default_factory=list)  # logits rows holding NaN or Inf
    row_errors: dict[int, str] = field(default_factory=dict)  # rows whose sampling raised
    score: object = None  # parallel.sharded_logprobs.LogprobRows for batch.score_indices, if any
    comm_total_s: float = 0.0  # collectives in flight, start to finish (>= collective_s)
    graph: str = ""  # the compiled graph that ran the step ("decode-4", "layers"); "" eager
