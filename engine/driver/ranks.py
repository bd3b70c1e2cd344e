"""Where a replica's ranks run: the worker in this process (one rank), or one Ray actor per rank.

Both have one face, so a replica never asks which it has: `launch(fn, *args)` starts
`fn(worker, *args)` on every rank (SPMD; `fn` a `Worker` method or a module-level function),
`collect(pending)` returns every rank's result in rank order (a bounded wait on Ray), and
`actors()`, `node_ips()`, `node_ids()`, `shutdown()` say where they are and end them.
"""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from engine.config import EngineConfig
from engine.errors import ConfigError, RankFailure
from engine.loading.checkpoint import Checkpoint
from engine.plan import EnginePlan
from engine.rank.worker import Worker

if TYPE_CHECKING:
    from parallel.ray.rank_group import RankGroup


class LocalRank:
    """The one rank of a replica, in the driver's process; a call runs as it is launched."""

    def __init__(self, plan: EnginePlan, checkpoint: Checkpoint):
        self.worker: Worker | None = Worker(plan, checkpoint=checkpoint, device=plan.device)

    def launch(self, fn: Callable[..., Any], *args: Any) -> list:
        if self.worker is None:
            raise RankFailure("this replica was shut down")
        return [fn(self.worker, *args)]

    def collect(self, pending: list) -> list:
        return pending

    def actors(self) -> None:
        """No actor: another engine's ranks cannot call this rank."""
        return None

    def node_ips(self) -> list[str]:
        return ["local"]

    def node_ids(self) -> list[str]:
        return ["local"]

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.release_memory()
        self.worker = None


# builds one replica's ranks; called again to replace them after a failure
RankStarter = Callable[[], "LocalRank | RankGroup"]


def uses_ray(cfg: EngineConfig) -> bool:
    return not (cfg.tp == 1 and cfg.cp == 1 and cfg.dp == 1 and cfg.executor == "auto")


def connect_if_needed(cfg: EngineConfig) -> None:
    """Join or start the Ray cluster the ranks will need, from the calling thread (Ray installs
    its signal handlers only from the main thread)."""
    if uses_ray(cfg):
        from parallel.ray import cluster

        cluster.connect(cfg.ray_address)


def rank_starters(plan: EnginePlan, cfg: EngineConfig, checkpoint: Checkpoint) -> list[RankStarter]:
    """One starter per data-parallel replica (Ray already joined: `connect_if_needed`); a Ray
    replica's starter places its ranks on the nodes chosen here, the first time and after a
    failure alike."""
    if not uses_ray(cfg):
        return [partial(LocalRank, plan, checkpoint)]
    from parallel.ray import cluster

    try:
        nodes = cluster.plan_replicas(cfg.dp, cfg.tp, cfg.device, cfg.cpus_per_rank, cfg.cp)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return [partial(_rank_group, plan, cfg, replica_nodes) for replica_nodes in nodes]


def _rank_group(plan: EnginePlan, cfg: EngineConfig, nodes: list[str]) -> RankGroup:
    """`cp x tp` rank actors, each TP group packed on one node (`nodes[c]` for context rank c),
    each rank building its own `Worker` from the plan; a broken group raises `RankFailure`."""
    from parallel.ray.rank_group import GroupOptions, RankGroup

    ifname = cfg.socket_ifname
    options = GroupOptions(world_size=cfg.tp * cfg.cp, device=cfg.device,
                           init_timeout_s=cfg.init_timeout_s, step_timeout_s=cfg.step_timeout_s,
                           collective_timeout_s=cfg.collective_timeout_s,
                           env={"GLOO_SOCKET_IFNAME": ifname, "NCCL_SOCKET_IFNAME": ifname}
                           if ifname else {}, ranks_per_node=cfg.tp, node_ids=nodes,
                           error=RankFailure, num_cpus=cfg.cpus_per_rank)
    return RankGroup(Worker, options, plan)
