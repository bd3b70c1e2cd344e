"""A rank's timing of one step: the forward's host time and its collective time (exposed and
in flight), read from the rank's collective clock (its `TensorGroup`'s)."""
from __future__ import annotations

import time

import torch

from engine.batch import StepResult
from parallel.comm import CollectiveClock


class StepTimer:
    """Marks taken when a step starts; `result()` turns them into rank 0's StepResult."""

    def __init__(self, rank: int, clock: CollectiveClock, cuda_device: torch.device | None):
        """`cuda_device`: the rank's GPU, whose queue the host waits on before reading time."""
        self.rank, self.clock, self.cuda_device = rank, clock, cuda_device
        self.start = time.perf_counter()
        self.exposed, self.busy = clock.seconds, clock.busy_seconds

    def result(self, score=None) -> StepResult | None:
        """Rank 0's result so far (the forward's time and its exposed and total collective
        time); None on the other ranks, which queue the next step at once."""
        if self.rank != 0:
            self.clock.discard()
            return None
        if self.cuda_device is not None:  # the timers read host time: let the device catch up
            torch.cuda.synchronize(self.cuda_device)
        self.clock.settle()
        result = StepResult([], None, time.perf_counter() - self.start,
                            self.clock.seconds - self.exposed, score=score)
        result.comm_total_s = self.clock.busy_seconds - self.busy
        return result
