"""A table of leases held by one owner and claimed by anyone: the owner adds an id with a time to
live; a claimer takes it (once), then settles it as used or hands it back; the owner collects the
ids that are finished (used, released or expired) to reclaim what they held.

It runs as a small Ray actor (no CPU reserved) so that claims from any process or node are atomic,
and it dies with its owner, which is how a claimer learns that the owner is gone.
"""
from __future__ import annotations

import time

import ray

HELD, CLAIMED, USED, RELEASED, EXPIRED = "held", "claimed", "used", "released", "expired"
_REMEMBERED = 100_000


class LeaseTable:
    def __init__(self) -> None:
        self._state: dict[str, str] = {}
        self._deadline: dict[str, float] = {}
        self._finished: list[str] = []  # not yet collected by the owner

    def add(self, key: str, ttl_s: float) -> None:
        self._state[key] = HELD
        self._deadline[key] = time.monotonic() + ttl_s

    def claim(self, key: str) -> str | None:
        """None: the caller now holds it; else why not (used, released, expired, unknown)."""
        self._expire()
        state = self._state.get(key, "unknown")
        if state != HELD:
            return state
        self._state[key] = CLAIMED
        return None

    def settle(self, key: str, used: bool) -> None:
        """The claimer is done: the lease is used up, or back to held (the claim failed)."""
        if self._state.get(key) == CLAIMED:
            self._state[key] = USED if used else HELD
            if used:
                self._finished.append(key)

    def release(self, key: str) -> str | None:
        """The owner gives it up; None, or why it cannot (claimed right now, or already over)."""
        self._expire()
        state = self._state.get(key, "unknown")
        if state != HELD:
            return state
        self._state[key] = RELEASED
        self._finished.append(key)
        return None

    def collect(self) -> list[str]:
        """The ids finished since the last collect."""
        self._expire()
        done, self._finished = self._finished, []
        # finished ids are kept to say why a late claim fails, the oldest forgotten past a bound
        over = len(self._state) - _REMEMBERED
        for key in [k for k, v in self._state.items() if v not in (HELD, CLAIMED)][:max(0, over)]:
            del self._state[key]
        return done

    def _expire(self) -> None:
        now = time.monotonic()
        for key, deadline in list(self._deadline.items()):
            if self._state[key] != HELD:
                if self._state[key] != CLAIMED:  # a claim in flight outlives the deadline
                    del self._deadline[key]
                continue
            if now >= deadline:
                self._state[key] = EXPIRED
                self._finished.append(key)
                del self._deadline[key]


def start_lease_table() -> "ray.actor.ActorHandle":
    return ray.remote(num_cpus=0)(LeaseTable).remote()
