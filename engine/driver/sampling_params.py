"""How the next tokens of one request are chosen, and when it stops."""
from __future__ import annotations

from dataclasses import dataclass

from engine.batch import SamplingSpec
from engine.errors import InvalidRequestError


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens={self.max_tokens!r}: use a positive integer")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature={self.temperature}: use 0 (greedy) or more")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p={self.top_p}: use a value in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k={self.top_k!r}: use 0 (off) or a positive integer")

    def spec(self, step: int) -> SamplingSpec:
        return SamplingSpec(self.temperature, self.top_k, self.top_p, self.seed, step)
