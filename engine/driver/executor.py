"""How the driver reaches one replica's ranks: the worker in this process (one rank), or one Ray
actor per rank. Both run the same `Worker` method on every rank (SPMD); the driver calls the
typed methods of `Executor` and never names a rank method by string."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

from engine.batch import Batch, StepResult
from engine.config import EngineConfig
from engine.errors import ConfigError, RankFailure
from engine.loading.checkpoint import Checkpoint
from engine.plan import EnginePlan, RankInfo
from engine.rank.worker import Worker


@dataclass(frozen=True, slots=True)
class Finished:
    """The in-process executor's "pending" call: it ran at launch."""

    results: list[Any]


class Executor(ABC):
    @abstractmethod
    def _launch(self, method: Callable, *args: Any) -> Any:
        """Start `method` (a Worker method) on every rank; a handle for `_collect`."""

    @abstractmethod
    def _collect(self, pending: Any) -> list:
        """Every rank's result of a `_launch`, in rank order (bounded wait)."""

    @abstractmethod
    def node_addresses(self) -> list[tuple[str, str]]:
        """(node ip, node id) of every rank."""

    @abstractmethod
    def shutdown(self) -> None: ...

    @abstractmethod
    def replacement(self) -> "Executor":
        """A fresh executor of the same ranks on the same nodes (this one's group broke)."""

    def _call(self, method: Callable, *args: Any) -> list:
        return self._collect(self._launch(method, *args))

    def start_step(self, batch: Batch) -> Any:
        return self._launch(Worker.execute, batch)

    def finish_step(self, pending: Any) -> StepResult:
        return self._collect(pending)[0]  # rank 0 samples and answers for the group

    def info(self) -> list[RankInfo]:
        return self._call(Worker.info)

    def weight_digests(self) -> list[dict]:
        """Every rank's digests of the weight slices it loaded (engine/loading/weight_digest.py)."""
        return self._call(Worker.weight_digest)

    def read_kv(self, layer: int, block_table: list[int], length: int) -> list[tuple]:
        return self._call(Worker.read_kv, layer, block_table, length)

    def export_kv(self, items: list[tuple[list[int], int]]) -> list[list]:
        """Per rank, per (block table, length): refs[layer][local kv head] of published K/V."""
        return self._call(Worker.export_kv, items)

    def rank_actors(self) -> list | None:
        """The Ray actor of every rank (another engine's ranks may call them), or None."""
        return None

    def import_kv(self, items: list[tuple[dict, list[int], int]], timeout_s: float) -> list[list]:
        """Per rank, per item: None, or why that rank could not pull its heads."""
        return self._call(Worker.import_kv, items, timeout_s)

    def memory(self) -> list[dict]:
        return self._call(Worker.memory)

    def start_tracing(self) -> None:
        self._call(Worker.start_tracing)

    def stop_tracing(self) -> list[list[dict]]:
        return self._call(Worker.stop_tracing)


class InProcessExecutor(Executor):
    def __init__(self, plan: EnginePlan, checkpoint: Checkpoint):
        self._plan, self._checkpoint = plan, checkpoint
        self.worker: Worker | None = Worker(plan, checkpoint=checkpoint, device=plan.device)

    def _launch(self, method: Callable, *args: Any) -> Finished:
        if self.worker is None:
            raise RankFailure("this replica was shut down")
        return Finished([method(self.worker, *args)])

    def _collect(self, pending: Finished) -> list:
        return pending.results

    def node_addresses(self) -> list[tuple[str, str]]:
        return [("local", "local")]

    def shutdown(self) -> None:
        self.worker = None

    def replacement(self) -> "InProcessExecutor":
        return InProcessExecutor(self._plan, self._checkpoint)


class RayExecutor(Executor):
    """`cp x tp` rank actors, each TP group packed on one node (`nodes[c]` for context rank c),
    each rank building its own `Worker` from the plan; a broken group raises `RankFailure`."""

    def __init__(self, plan: EnginePlan, cfg: EngineConfig, nodes: list[str] | None):
        from parallel.ray.rank_group import GroupOptions, RankGroup

        self._plan, self._cfg, self._nodes = plan, cfg, nodes
        ifname = cfg.socket_ifname
        options = GroupOptions(world_size=cfg.tp * cfg.cp, device=cfg.device,
                               init_timeout_s=cfg.init_timeout_s, step_timeout_s=cfg.step_timeout_s,
                               collective_timeout_s=cfg.collective_timeout_s,
                               env={"GLOO_SOCKET_IFNAME": ifname, "NCCL_SOCKET_IFNAME": ifname}
                               if ifname else {}, ranks_per_node=cfg.tp, node_ids=nodes,
                               error=RankFailure,
                               num_cpus=cfg.cpus_per_rank)
        self.group = RankGroup(Worker, options, plan)

    def _launch(self, method: Callable, *args: Any) -> Any:
        return self.group.launch(method.__name__, *args)

    def _collect(self, pending: Any) -> list:
        return self.group.collect(pending)

    def node_addresses(self) -> list[tuple[str, str]]:
        return list(zip(self.group.node_ips(), self.group.node_ids()))

    def rank_actors(self) -> list:
        return self.group.actors()

    def shutdown(self) -> None:
        self.group.shutdown()

    def replacement(self) -> "RayExecutor":
        return RayExecutor(self._plan, self._cfg, self._nodes)


def uses_ray(cfg: EngineConfig) -> bool:
    return not (cfg.tp == 1 and cfg.cp == 1 and cfg.dp == 1 and cfg.executor == "auto")


def connect_if_needed(cfg: EngineConfig) -> None:
    """Join or start the Ray cluster the ranks will need, from the calling thread (Ray installs
    its signal handlers only from the main thread)."""
    if uses_ray(cfg):
        from parallel.ray import cluster

        cluster.connect(cfg.ray_address)


def make_executors(plan: EnginePlan, cfg: EngineConfig, checkpoint: Checkpoint) -> list[Executor]:
    """One executor per data-parallel replica (Ray already joined: `connect_if_needed`)."""
    if not uses_ray(cfg):
        return [InProcessExecutor(plan, checkpoint)]
    from parallel.ray import cluster

    try:
        nodes = cluster.plan_replicas(cfg.dp, cfg.tp, cfg.device, cfg.cpus_per_rank, cfg.cp)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    executors: list[Executor] = []
    try:
        for node in nodes:
            executors.append(RayExecutor(plan, cfg, node))
    except BaseException:
        for ex in executors:
            ex.shutdown()
        raise
    return executors
