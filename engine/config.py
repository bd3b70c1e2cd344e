"""Engine settings. Field names match the Hydra keys (`engine.*`, `parallel.*`) one to one, and
are the keyword arguments of `LLM(...)`."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from engine.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class EngineConfig:
    model: str = "smollm2"
    # parallel.*
    tp: int = 1
    dp: int = 1
    executor: str = "auto"  # auto: in-process for one rank, Ray actors for more; or "ray"
    init_timeout_s: float = 120.0
    step_timeout_s: float = 30.0  # a dead or hung rank fails the step within this
    collective_timeout_s: float = 60.0  # torch.distributed's own bound on one collective
    retry_on_rank_failure: bool = False  # restart the groups once and rerun the requests
    ray_address: str | None = None  # None: $RAY_ADDRESS, else a local cluster
    socket_ifname: str | None = None  # network interface for gloo/NCCL between nodes
    cpus_per_rank: float = 1.0  # Ray logical CPUs one rank actor asks for (fractions share cores)
    # engine.*
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    max_model_len: int | None = None  # None: the model's context length
    block_size: int = 16
    kv_cache_gb: float = 0.5
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # auto: triton on CUDA, torch on CPU
    num_threads: int | None = None
    kv_handle_ttl_s: float = 300.0  # an exported KVHandle's blocks are reclaimed after this

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine setting(s) {unknown}; known: {sorted(known)}")
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    @property
    def torch_dtype(self) -> torch.dtype:
        name = self.dtype or ("float32" if self.device == "cpu" else "bfloat16")
        return DTYPES[name]

    def validate(self) -> None:
        _require(isinstance(self.tp, int) and self.tp >= 1, f"tp={self.tp!r}: use a positive integer")
        _require(isinstance(self.dp, int) and self.dp >= 1, f"dp={self.dp!r}: use a positive integer")
        _require(self.executor in ("auto", "ray"), f"executor={self.executor!r}: use 'auto' or 'ray'")
        _require(self.device == "cpu" or self.device.startswith("cuda"),
                 f"device={self.device!r}: use 'cpu' or 'cuda'")
        _require(self.dtype is None or self.dtype in DTYPES,
                 f"dtype={self.dtype!r}: use one of {sorted(DTYPES)}")
        _require(self.block_size >= 1, f"block_size={self.block_size}: use a positive integer")
        _require(self.kv_cache_gb > 0, f"kv_cache_gb={self.kv_cache_gb}: use a positive size")
        _require(self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens={self.max_num_batched_tokens}: use a positive integer")
        _require(self.max_num_seqs >= 1, f"max_num_seqs={self.max_num_seqs}: use a positive integer")
        _require(self.kv_handle_ttl_s > 0,
                 f"kv_handle_ttl_s={self.kv_handle_ttl_s}: use a positive number of seconds")
        _require(self.cpus_per_rank > 0,
                 f"cpus_per_rank={self.cpus_per_rank}: use a positive number, e.g. 0.5")
        _require(self.attention_backend in ("auto", "torch", "triton"),
                 f"attention_backend={self.attention_backend!r}: use 'auto', 'torch' or 'triton'")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
