"""One tensor-parallel group and the driver-side state that feeds it: block manager, scheduler.

A data-parallel engine holds several; each serves its own requests with its own KV cache. Code
beside the driver (transfer/, the LLM) reaches a replica's ranks and blocks only through the
public methods here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from engine.config import EngineConfig
from engine.driver.block_manager import BlockManager
from engine.driver.ranks import RankStarter, rank_starters
from engine.driver.scheduler import Scheduler
from engine.driver.whole_prompts import WholePromptScheduler
from engine.driver.sequence import Sequence
from engine.loading.checkpoint import Checkpoint
from engine.plan import EnginePlan
from engine.rank.worker import Worker


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
    pending: Any  # the ranks' handle for `collect`


def start_replicas(plan: EnginePlan, cfg: EngineConfig, checkpoint: Checkpoint) -> list[Replica]:
    """Every data-parallel replica, its ranks up; none left running if one fails to start."""
    replicas: list[Replica] = []
    try:
        for start in rank_starters(plan, cfg, checkpoint):
            replicas.append(Replica(plan, cfg, start))
    except BaseException:
        for replica in replicas:
            replica.shutdown()
        raise
    return replicas


class Replica:
    def __init__(self, plan: EnginePlan, cfg: EngineConfig, start_ranks: RankStarter):
        self._plan, self._cfg, self._start_ranks = plan, cfg, start_ranks
        self._ranks = start_ranks()
        self.down: str | None = None  # why its group broke; it takes no requests until replaced
        try:
            self.rank_info = self.run_on_ranks(Worker.info)
        except BaseException:
            self._ranks.shutdown()
            raise
        self.block_manager = BlockManager(plan.num_blocks, plan.block_size,
                                          cfg.enable_prefix_caching, cp=plan.cp)
        # cp > 1: prompts are split over context ranks on arrival, so they run whole
        scheduler = WholePromptScheduler if plan.cp > 1 else Scheduler
        self.scheduler = scheduler(self.block_manager, cfg.max_num_batched_tokens,
                                   cfg.max_num_seqs, plan.max_model_len, plan.model.eos_token_ids)
        self.steps: list[StepTiming] = []

    def restarted(self) -> "Replica":
        """A new replica on fresh ranks in this one's place (same nodes), its cache empty."""
        return Replica(self._plan, self._cfg, self._start_ranks)

    def run_on_ranks(self, fn: Callable[..., Any], *args: Any) -> list:
        """`fn(worker, *args)` on every rank (a `Worker` method, or a module-level function of
        a layer above the rank); every rank's result, in rank order."""
        return self._ranks.collect(self._ranks.launch(fn, *args))

    def rank_actors(self) -> list | None:
        """The Ray actor of every rank (another engine's ranks may call them), or None."""
        return self._ranks.actors()

    def node_addresses(self) -> list[tuple[str, str]]:
        """(node ip, node id) of every rank."""
        return list(zip(self._ranks.node_ips(), self._ranks.node_ids()))

    def shutdown(self) -> None:
        self._ranks.shutdown()

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
                            self._ranks.launch(Worker.execute, batch))

    def finish(self, step: InFlightStep) -> list[Sequence]:
        """Wait for the step's result and advance its sequences; those that finished."""
        result = self._ranks.collect(step.pending)[0]  # rank 0 samples and answers for the group
        finished = self.scheduler.postprocess(step.scheduled, result.token_ids, result.logits,
                                              set(result.nonfinite_rows), result.row_errors,
                                              result.score)
        self.steps.append(StepTiming(time.perf_counter() - step.started, step.schedule_s,
                                     result.forward_s, result.collective_s, result.sample_s,
                                     step.num_tokens, len(step.scheduled), result.comm_total_s,
                                     result.graph))
        return finished

    def stats(self) -> dict:
        """Blocks used/free/pinned, prefix-cache hits, preemptions, requests, per-rank KV bytes."""
        stats = self.block_manager.stats()
        stats["kv_bytes_per_token_per_rank"] = [i.kv_bytes_per_token for i in self.rank_info]
        stats["kv_cache_bytes_per_rank"] = [i.kv_cache_bytes for i in self.rank_info]
        stats["preemptions"] = self.scheduler.num_preemptions
        stats["requests_running"] = len(self.scheduler.running)
        stats["requests_waiting"] = len(self.scheduler.waiting)
        return stats

    # ---- for a KV hand-off (engine/transfer/), on the step loop's thread --------------------

    def kv_room(self) -> tuple[int, int]:
        """(free blocks, all blocks) of this replica's KV cache."""
        return self.block_manager.num_free_blocks, self.block_manager.num_blocks

    def reserve_kv(self, num_tokens: int) -> list[int] | None:
        """Fresh blocks for `num_tokens` whose K/V come from outside (an imported request);
        None if they do not fit now."""
        return self.block_manager.allocate_blocks(self.block_manager.blocks_for(num_tokens))

    def free_kv(self, block_table: list[int]) -> None:
        """Give back blocks `reserve_kv` gave (an import that failed)."""
        self.block_manager.free_blocks(block_table)

    def unpin_kv(self, block_table: list[int]) -> None:
        """Give back the blocks a finished, exported sequence left pinned."""
        self.block_manager.unpin(block_table)

    def adopt(self, seq: Sequence) -> bool:
        """Enter an imported sequence (its blocks reserved and written, its first token in) as
        running; True if it finished at once (EOS or max_tokens=1)."""
        seq.replica = self
        return self.scheduler.adopt(seq)

    def abort_all(self) -> list[Sequence]:
        """Forget every request this replica holds (its group broke); they are returned."""
        seqs = list(self.scheduler.waiting) + list(self.scheduler.running)
        self.scheduler.abort(seqs)
        return seqs
