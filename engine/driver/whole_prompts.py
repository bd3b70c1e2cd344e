"""The scheduler for context parallelism: prompts run whole, never in chunks, and the ranks
place their own positions' K/V.

Context ranks split each prompt between them when it arrives (cp_layout), so a prompt must come
in one step. The plain scheduler gives a prompt whatever token budget is left; this one leaves
a prompt that does not fit for a later step instead (make_plan has checked that the budget
holds the longest prompt, so an empty step always has room for one).
"""
from __future__ import annotations

from engine.driver.scheduler import Scheduler
from engine.driver.sequence import Sequence


class WholePromptScheduler(Scheduler):
    def schedule(self) -> list[tuple[Sequence, int]]:
        # a prompt granted less than all its pending tokens waits; nothing was changed for it
        # yet (its blocks are its own from admission on), so dropping the grant is safe
        return [(seq, n) for seq, n in super().schedule()
                if n == seq.num_pending_tokens]

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        # each context rank places the positions it keeps itself (cp_layout.local_slot); the
        # table is shorter than the sequence, so there is no whole-sequence slot to give
        return [-1] * (end - start)
