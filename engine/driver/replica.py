"""One tensor-parallel group and the driver-side state that feeds it: block manager, scheduler.

A data-parallel engine holds several; each serves its own requests with its own KV cache.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from engine.driver.block_manager import BlockManager
from engine.config import EngineConfig
from engine.driver.executor import Executor
from engine.driver.sequence import Sequence
from engine.driver.scheduler import Scheduler


@dataclass(slots=True)
class StepTiming:
    """Where one step's wall time went, as seen by the driver."""

    wall_s: float = 0.0
    schedule_s: float = 0.0  # the driver choosing tokens and building the batch
    forward_s: float = 0.0  # rank 0 inside the forward pass
    collective_s: float = 0.0  # rank 0 inside all-reduce/gather, part of forward_s
    sample_s: float = 0.0  # rank 0 choosing the next tokens

    @property
    def overhead_s(self) -> float:
        """Everything outside the ranks' compute: scheduling, the batch's trip to the ranks and
        the result's trip back."""
        return self.wall_s - self.forward_s - self.sample_s

    @property
    def transfer_s(self) -> float:
        return self.overhead_s - self.schedule_s


class Replica:
    def __init__(self, cfg: EngineConfig, executor: Executor, max_model_len: int,
                 eos_token_ids: list[int]):
        self.executor = executor
        self.rank_info = executor.call("info")
        num_blocks = min(info["num_blocks"] for info in self.rank_info)
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                   max_model_len, eos_token_ids)
        self.steps: list[StepTiming] = []

    @property
    def load(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def launch(self):
        """Schedule and start one step on the ranks; None when there is nothing to run."""
        if not self.scheduler.has_work():
            return None
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            raise RuntimeError("scheduler found nothing to run while requests are pending")
        batch = self.scheduler.build_batch(scheduled)
        scheduled_at = time.perf_counter()
        return start, scheduled_at - start, scheduled, self.executor.launch("execute", batch)

    def finish(self, launched) -> list[Sequence]:
        start, schedule_s, scheduled, handle = launched
        result = self.executor.collect("execute", handle)[0]
        finished = self.scheduler.postprocess(scheduled, result.token_ids, result.logits,
                                              set(result.nonfinite_rows), result.score)
        self.steps.append(StepTiming(time.perf_counter() - start, schedule_s, result.forward_s,
                                     result.collective_s, result.sample_s))
        return finished
