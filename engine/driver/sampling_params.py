"""How the next tokens of one request are chosen, and when it stops.

Every value is checked on the driver, at construction and again at submission (`check_params`),
so a bad one never reaches a rank, where it would fail a whole TP group."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from engine.batch import SamplingSpec
from engine.errors import InvalidRequestError

# Below this, logits / temperature can overflow float32 (|logit| ~ 3e34 suffices at 1e-4, far
# past any real model) and the draw is the argmax anyway; 0 asks for exactly that.
MIN_TEMPERATURE = 1e-4


# numpy's integers and floats (an eval harness's arithmetic) count as ints and numbers: they are
# numbers.Integral / numbers.Real, and validate() turns them into Python's own


def _int_problem(name: str, value, minimum: int, fix: str) -> str | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # True: not to us
        return f"{name}={value!r} is a {type(value).__name__}; {fix}"
    if value < minimum:
        return f"{name}={value!r}: {fix}"
    return None


def _float_problem(name: str, value) -> str | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"{name}={value!r} is a {type(value).__name__}; pass a number"
    if not math.isfinite(value):
        return f"{name}={value!r}: pass a finite number"
    return None


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy; else at least MIN_TEMPERATURE
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None  # any int >= 0, however large (e.g. time.time_ns())
    ignore_eos: bool = False

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad value and its fix; else make every
        number Python's own int or float (numpy's scalars too)."""
        problem = (
            _int_problem("max_tokens", self.max_tokens, 1, "use a positive integer")
            or _float_problem("temperature", self.temperature)
            or self._temperature_problem()
            or _int_problem("top_k", self.top_k, 0, "use 0 (off) or a positive integer")
            or _float_problem("top_p", self.top_p)
            or (None if 0 < self.top_p <= 1 else f"top_p={self.top_p}: use a value in (0, 1]")
            or (None if self.seed is None else _int_problem(
                "seed", self.seed, 0, "use None (a random draw) or an integer >= 0"))
            or (None if isinstance(self.ignore_eos, bool)
                else f"ignore_eos={self.ignore_eos!r}: use True or False"))
        if problem:
            raise InvalidRequestError(problem)
        self.max_tokens, self.top_k = int(self.max_tokens), int(self.top_k)
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        self.seed = None if self.seed is None else int(self.seed)

    def _temperature_problem(self) -> str | None:
        t = self.temperature
        if t < 0:
            return f"temperature={t}: use 0 (greedy) or more"
        if 0 < t < MIN_TEMPERATURE:
            return (f"temperature={t}: use 0 for greedy, or at least {MIN_TEMPERATURE} (smaller "
                    f"values overflow the scaled logits and sample the argmax anyway)")
        return None

    def spec(self, step: int) -> SamplingSpec:
        return SamplingSpec(float(self.temperature), self.top_k, float(self.top_p), self.seed, step)


def check_params(params) -> SamplingParams:
    """The request's SamplingParams, re-checked (fields may have changed since construction);
    None means the defaults. Anything else, a dict included, is refused rather than ignored."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        hint = ""
        if isinstance(params, dict):
            args = ", ".join(f"{k}={v!r}" for k, v in params.items())
            hint = f"; write SamplingParams({args})"
        raise InvalidRequestError(
            f"params must be a SamplingParams (or None for the defaults), got "
            f"{type(params).__name__}{hint}")
    params.validate()
    return params
