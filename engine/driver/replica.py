"""One tensor-parallel group and the driver-side state that feeds it: block manager, scheduler.

A data-parallel engine holds several; each serves its own requests with its own KV cache.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.driver.block_manager import BlockManager
from engine.driver.executor import Executor
from engine.driver.scheduler import Scheduler
from engine.driver.whole_prompts import WholePromptScheduler
from engine.driver.sequence import Sequence
from engine.plan import EnginePlan


@dataclass(slots=True)
class StepTiming:
    """Where one step's wall time went, as seen by the driver."""

    wall_s: float = 0.0
    schedule_s: float = 0.0  # the driver choosing tokens and building the batch
    forward_s: float = 0.0  # rank 0 inside the forward pass
    collective_s: float = 0.0  # rank 0 inside all-reduce/gather, part of forward_s
    sample_s: float = 0.0  # rank 0 choosing the next tokens
    num_tokens: int = 0  # tokens the step ran through the model
    num_seqs: int = 0
    comm_total_s: float = 0.0  # rank 0's collectives in flight, start to finish, overlapped or not
    graph: str = ""  # compile=True: the graph that ran the step ("decode-4": 4 padded rows)

    @property
    def comm_exposed_s(self) -> float:
        """Rank 0 blocked on a collective: the communication compute did not hide."""
        return self.collective_s

    @property
    def overhead_s(self) -> float:
        """Everything outside the ranks' compute: scheduling, the batch's trip to the ranks and
        the result's trip back."""
        return self.wall_s - self.forward_s - self.sample_s

    @property
    def transfer_s(self) -> float:
        return self.overhead_s - self.schedule_s


@dataclass(slots=True)
class InFlightStep:
    """A step launched on the ranks whose result has not come back yet."""

    scheduled: list[tuple[Sequence, int]]
    started: float
    schedule_s: float
    num_tokens: int
    pending: Any  # the executor's handle


class Replica:
    def __init__(self, plan: EnginePlan, cfg: EngineConfig, executor: Executor):
        self._plan, self._cfg = plan, cfg
        self.executor = executor
        self.down: str | None = None  # why its group broke; it takes no requests until replaced
        self.rank_info = executor.info()
        self.block_manager = BlockManager(plan.num_blocks, plan.block_size,
                                          cfg.enable_prefix_caching, cp=plan.cp)
        # cp > 1: prompts are split over context ranks on arrival, so they run whole
        scheduler = WholePromptScheduler if plan.cp > 1 else Scheduler
        self.scheduler = scheduler(self.block_manager, cfg.max_num_batched_tokens,
                                   cfg.max_num_seqs, plan.max_model_len, plan.model.eos_token_ids)
        self.steps: list[StepTiming] = []

    def restarted(self) -> "Replica":
        """A new replica on fresh ranks in this one's place (same nodes), its cache empty."""
        return Replica(self._plan, self._cfg, self.executor.replacement())

    @property
    def load(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def launch(self) -> InFlightStep | None:
        """Schedule and start one step on the ranks; None when there is nothing to run."""
        if not self.scheduler.has_work():
            return None
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled:  # every request waits for blocks that running ones hold: impossible
            raise RuntimeError("scheduler found nothing to run while requests are pending")
        batch = self.scheduler.build_batch(scheduled)
        return InFlightStep(scheduled, start, time.perf_counter() - start, batch.num_tokens,
                            self.executor.start_step(batch))

    def finish(self, step: InFlightStep) -> list[Sequence]:
        """Wait for the step's result and advance its sequences; those that finished."""
        result = self.executor.finish_step(step.pending)
        finished = self.scheduler.postprocess(step.scheduled, result.token_ids, result.logits,
                                              set(result.nonfinite_rows), result.row_errors,
                                              result.score)
        self.steps.append(StepTiming(time.perf_counter() - step.started, step.schedule_s,
                                     result.forward_s, result.collective_s, result.sample_s,
                                     step.num_tokens, len(step.scheduled), result.comm_total_s,
                                     result.graph))
        return finished

    def abort_all(self) -> list[Sequence]:
        """Forget every request this replica holds (its group broke); they are returned."""
        seqs = list(self.scheduler.waiting) + list(self.scheduler.running)
        self.scheduler.abort(seqs)
        return seqs
