"""How the driver reaches one replica's ranks: the worker in this process (one rank), or one Ray
actor per rank. Both launch a method on every rank and collect one result per rank."""
from __future__ import annotations

from engine.loading.checkpoint import Checkpoint
from engine.config import EngineConfig
from engine.errors import ConfigError, RankFailure
from engine.rank.worker import Worker


class Executor:
    """launch(method, *args) starts it on every rank; collect(method, handle) waits for the
    results, one per rank in rank order."""

    def launch(self, method: str, *args):
        raise NotImplementedError

    def collect(self, method: str, handle) -> list:
        raise NotImplementedError

    def call(self, method: str, *args) -> list:
        return self.collect(method, self.launch(method, *args))

    def node_ips(self) -> list[str]:
        raise NotImplementedError

    def node_ids(self) -> list[str]:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


class InProcessExecutor(Executor):
    def __init__(self, cfg: EngineConfig, checkpoint: Checkpoint):
        self.worker = Worker(cfg, checkpoint=checkpoint)

    def launch(self, method: str, *args) -> list:
        return [getattr(self.worker, method)(*args)]

    def collect(self, method: str, handle: list) -> list:
        return handle

    def node_ips(self) -> list[str]:
        return ["local"]

    def node_ids(self) -> list[str]:
        return ["local"]

    def shutdown(self) -> None:
        self.worker = None


class RayExecutor(Executor):
    """`tp` rank actors packed on one node, each building its own `Worker` from the checkpoint."""

    def __init__(self, cfg: EngineConfig, node_id: str | None):
        from parallel.rank_group import GroupOptions, RankGroup, RankGroupError

        self._errors = RankGroupError
        options = GroupOptions(world_size=cfg.tp, device=cfg.device,
                               init_timeout_s=cfg.init_timeout_s, step_timeout_s=cfg.step_timeout_s,
                               collective_timeout_s=cfg.collective_timeout_s,
                               env=_socket_env(cfg.socket_ifname), node_id=node_id)
        try:
            self.group = RankGroup(Worker, options, cfg)
        except RankGroupError as e:
            raise RankFailure(str(e)) from None

    def launch(self, method: str, *args) -> list:
        try:
            return self.group.call_async(method, *args)
        except self._errors as e:
            raise RankFailure(str(e)) from None

    def collect(self, method: str, handle: list) -> list:
        try:
            return self.group.collect(method, handle)
        except self._errors as e:
            raise RankFailure(str(e)) from None

    def node_ips(self) -> list[str]:
        return self.group.node_ips()

    def node_ids(self) -> list[str]:
        return self.group.node_ids()

    def shutdown(self) -> None:
        self.group.shutdown()


def _socket_env(ifname: str | None) -> dict[str, str]:
    return {"GLOO_SOCKET_IFNAME": ifname, "NCCL_SOCKET_IFNAME": ifname} if ifname else {}


def make_executors(cfg: EngineConfig, checkpoint: Checkpoint) -> list[Executor]:
    """One executor per data-parallel replica."""
    if cfg.tp == 1 and cfg.dp == 1 and cfg.executor == "auto":
        return [InProcessExecutor(cfg, checkpoint)]
    from parallel import cluster

    cluster.connect(cfg.ray_address)
    try:
        nodes = cluster.plan_replicas(cfg.dp, cfg.tp, cfg.device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    executors: list[Executor] = []
    try:
        for node in nodes:
            executors.append(RayExecutor(cfg, node))
    except BaseException:
        for ex in executors:
            ex.shutdown()
        raise
    return executors
