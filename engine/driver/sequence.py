"""One request's state on the driver: its tokens, how many have K/V in the cache, its blocks."""
from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Callable

from engine.driver.sampling_params import SamplingParams

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(StrEnum):
    """Why a request stopped; equal to its string value (`reason == "stop"`)."""

    STOP = "stop"  # sampled an end-of-sequence token
    # reached max_tokens or max_model_len (the cache always holds one max_model_len request)
    LENGTH = "length"
    NONFINITE = "nonfinite"  # the model gave NaN/Inf logits: the request fails
    SCORED = "scored"  # a scoring request: every position's log-probability is in
    ERROR = "error"  # sampling raised for this request's settings: the request fails
    # export_kv: pinning its blocks would leave too little cache for one max_model_len request
    EXPORT_REFUSED = "export_refused"
    ABORTED = "aborted"  # cancelled, or failed with the rest of its step


@dataclass(slots=True)
class Sequence:
    prompt_token_ids: list[int]
    params: SamplingParams
    seq_id: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of the prompt, served by the prefix cache
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks registered in the prefix cache
    parent_hash: int | None = None  # hash of the last registered block, the next one chains to it
    status: Status = Status.WAITING
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    keep_first_logits: bool = False
    first_logits: object = None
    finish_reason: FinishReason | None = None
    error: str | None = None  # with FinishReason.ERROR: what the rank said
    kv_block_table: list[int] = field(default_factory=list)  # where its K/V stayed when it finished
    pin_kv: bool = False  # export_kv: on finishing, keep the blocks referenced for a KVHandle
    # the Replica serving it (by identity: one rebuilt after a failure is another object)
    replica: object = None
    retried: bool = False  # resumed once after its replica's group broke (never twice)
    # resolved by the step loop when the request ends; on_token sees each new token as it comes
    future: Future = field(default_factory=Future)
    on_token: Callable[[int], None] | None = None
    score: object = None  # engine.driver.scoring.ScoreRequest: scored, never sampled

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)

    def resume(self) -> None:
        """Waiting again with no K/V anywhere (its group died): it recomputes the prompt and the
        tokens it already produced, then goes on from there, so a caller that saw those tokens
        (a stream) never sees them twice and greedy decoding gives `generate`'s tokens."""
        self.num_computed_tokens = self.num_cached_tokens = self.num_hashed_blocks = 0
        self.block_table, self.parent_hash = [], None
        self.status, self.finish_reason, self.error = Status.WAITING, None, None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens without K/V yet: the prompt (or what is left of it), or the last sampled token."""
        return self.num_tokens - self.num_computed_tokens
