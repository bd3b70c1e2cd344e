"""Which data-parallel replica takes a new request.

Least loaded: the replica with the fewest requests waiting or running; ties rotate, so
one-at-a-time traffic alternates too. Prefix affinity: the replica whose prefix cache holds more of
the prompt, but only where that pays:
- tokens every recent prompt starts with (a chat template, a shared system prompt) do not count:
  every replica caches them after one request, and counting them sent all chat traffic to the
  replica that served first; a recent prompt the new one wholly extends (an earlier turn of its
  conversation) is no template, and its blocks do count;
- the gain over the least loaded replica must be at least one KV block;
- and the preferred replica may be at most `AFFINITY_LOAD_SLACK` requests busier than the least
  loaded one (a hot prefix must not pile its requests onto one replica), as SGLang's cache-aware
  router falls back to the shortest queue when the loads drift apart.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.driver.replica import Replica

AFFINITY_LOAD_SLACK = 4
RECENT_PROMPTS = 8  # the window in which a prefix common to all prompts counts as shared


class Router:
    def __init__(self, prefix_affinity: bool, block_size: int):
        self._prefix_affinity = prefix_affinity
        self._block_size = block_size
        self._recent: deque[list[int]] = deque(maxlen=RECENT_PROMPTS)
        self._last = -1  # the replica picked last, where ties start rotating

    def pick(self, tokens: list[int], replicas: list[Replica]) -> int | None:
        """The index of the replica to serve `tokens`, or None when every replica is down."""
        live = [i for i, r in enumerate(replicas) if r.down is None]
        if not live:
            return None
        n = len(replicas)
        # lowest load; among equals, the first after the last pick
        least = min(live, key=lambda i: (replicas[i].load, (i - self._last - 1) % n))
        choice = least
        if self._prefix_affinity and len(live) > 1:
            choice = self._affine(tokens, replicas, live, least)
        self._recent.append(list(tokens))  # a copy: a sequence's own list grows as it decodes
        self._last = choice
        return choice

    def _affine(self, tokens: list[int], replicas: list[Replica], live: list[int],
                least: int) -> int:
        shared = self._shared_prefix(tokens)

        def gain(i: int) -> int:  # cached tokens beyond the shared prefix
            return max(0, replicas[i].block_manager.cached_prefix_tokens(tokens) - shared)

        best = max(live, key=lambda i: (gain(i), -replicas[i].load, i == least))
        pays = gain(best) - gain(least) >= self._block_size
        near = replicas[best].load - replicas[least].load <= AFFINITY_LOAD_SLACK
        return best if pays and near else least

    def _shared_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens `tokens` shares with every recent prompt that diverges from
        it (0 with none). A recent prompt that `tokens` wholly extends (an earlier turn of the
        same conversation, or the same prompt again) is not a template: its blocks pay."""
        others = [o for o in self._recent if not (len(o) <= len(tokens) and tokens[:len(o)] == o)]
        if not others:
            return 0
        shared = len(tokens)
        for other in others:
            shared = _common_prefix(tokens, other, shared)
            if shared == 0:
                break
        return shared


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of a and b, at most `limit`: a binary search over slice
    comparisons, which run in C (a prompt may be thousands of tokens)."""
    lo, hi = 0, min(limit, len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
