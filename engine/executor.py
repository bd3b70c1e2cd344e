"""How the driver reaches its ranks: the worker in this process (one rank), or one Ray actor per
rank. Both answer `call(method, ...)` with one result per rank, in rank order."""
from __future__ import annotations

from engine.checkpoint import Checkpoint
from engine.config import EngineConfig
from engine.worker import Worker


class InProcessExecutor:
    def __init__(self, cfg: EngineConfig, checkpoint: Checkpoint):
        self.worker = Worker(cfg, checkpoint=checkpoint)

    def call(self, method: str, *args, **kwargs) -> list:
        return [getattr(self.worker, method)(*args, **kwargs)]

    def shutdown(self) -> None:
        self.worker = None


def make_executor(cfg: EngineConfig, checkpoint: Checkpoint):
    if cfg.tp == 1 and cfg.executor == "auto":
        return InProcessExecutor(cfg, checkpoint)
    raise NotImplementedError("more than one rank needs the Ray executor (not built yet)")
