"""Bounded waits on every rank of a group: what each rank did (answered, raised, died, or said
nothing in time) and which rank to blame."""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayError, RayTaskError

# After one rank raised, how long the others get to answer before they count as stuck.
_RAISE_GRACE_S = 2.0
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its remote tracebacks


@dataclass(frozen=True, slots=True)
class PendingCall:
    """A method started on every rank whose results have not been collected yet."""

    method: str
    refs: list[ray.ObjectRef]


@dataclass(slots=True)
class _Outcome:
    """What each rank did within a bounded wait."""

    results: list[Any]
    raised: dict[int, RayTaskError] = field(default_factory=dict)   # the worker's own exception
    lost: dict[int, RayError] = field(default_factory=dict)         # actor died or Ray failed
    pending: list[int] = field(default_factory=list)                # no answer within the bound

    def failure(self) -> tuple[int, str] | None:
        """The rank to blame and why; a raised error explains a hang better than the hang does."""
        if self.lost:
            rank = min(self.lost)
            why = f"died: {self.lost[rank]}"
        elif self.raised:
            rank = min(self.raised)
            why = f"raised {self.raised[rank]}"
        elif self.pending:
            rank, why = self.pending[0], "did not answer in time"
        else:
            return None
        if self.pending:
            why += f" (ranks still running: {self.pending})"
        return rank, _ANSI.sub("", why)


def gather(refs: list[ray.ObjectRef], timeout_s: float) -> _Outcome:
    """Wait for one result per rank, up to `timeout_s`; stop early once an actor is lost, and
    soon after a rank raised: ranks that share its error raise within moments, and the rest
    are likely stuck in a collective the failed rank will never join."""
    deadline = time.monotonic() + timeout_s
    rank_of = {ref: r for r, ref in enumerate(refs)}
    out = _Outcome(results=[None] * len(refs))
    waiting = list(refs)
    while waiting and not out.lost:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, waiting = ray.wait(waiting, num_returns=1, timeout=left)
        for ref in ready:
            rank = rank_of[ref]
            try:
                out.results[rank] = ray.get(ref)
            except RayTaskError as err:
                out.raised[rank] = err
                deadline = min(deadline, time.monotonic() + _RAISE_GRACE_S)
            except RayError as err:
                out.lost[rank] = err
    out.pending = sorted(rank_of[ref] for ref in waiting)
    return out
