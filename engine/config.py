"""Engine settings. Field names match the Hydra keys (`engine.*`, `parallel.*`) one to one, and
are the keyword arguments of `LLM(...)`."""
from __future__ import annotations

import math
import numbers
import os
import re
from dataclasses import dataclass, fields

import torch

from engine.errors import ConfigError

# prefix_affinity: the replica caching more of the prompt where that pays (beyond the prefix every
# recent prompt shares, by a block, within a load slack; engine/driver/router.py), else the least
# loaded; least_loaded: the replica with the fewest requests waiting or running
ROUTINGS = ("prefix_affinity", "least_loaded")
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
    # rebuild a replica whose rank died (the others serve meanwhile) and resume its requests once
    retry_on_rank_failure: bool = False
    ray_address: str | None = None  # None: $RAY_ADDRESS, else a local cluster
    socket_ifname: str | None = None  # network interface for gloo/NCCL between nodes
    cpus_per_rank: float = 1.0  # Ray logical CPUs one rank actor asks for (fractions share cores)
    overlap_comm: bool = False  # two micro-batches a step: one's all-reduce behind the other
    # CPU ranks of one group on one machine sum through shared memory (parallel/shared_memory.py)
    # where it works there; False: torch.distributed's (gloo's) all-reduce
    shared_memory_all_reduce: bool = True
    cp: int = 1  # context-parallel ranks per replica: a replica is tp x cp rank actors
    routing: str = "prefix_affinity"  # dp > 1: which replica takes a request (see ROUTINGS)
    # engine.*
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    max_model_len: int | None = None  # None: the model's context length
    block_size: int = 16
    # None: 0.5 GiB on a CPU; on CUDA, what the GPU has free after the weights, less a headroom
    kv_cache_gb: float | None = None
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # auto: triton on CUDA, torch on CPU
    num_threads: int | None = None
    compile: bool | None = None  # torch.compile the layers; None: engine.plan.compiles decides
    kv_handle_ttl_s: float = 300.0  # an exported KVHandle's blocks are reclaimed after this
    # "bfloat16": decode steps read bf16 copies of the projection weights (float32 models on a
    # CPU; +50 % weight memory); None: every step reads the model's own weights
    decode_dtype: str | None = None
    # "measure": a CPU rank times its candidate kernels at start-up and runs the fastest per
    # shape (engine.rank.kernel_choice; kept on disk); "fixed": the built-in choice, untimed
    kernel_choice: str = "measure"
    # "int8" | "int4" | "gguf": the projections as integer codes and scales, run by weight-only
    # int8/int4 kernels (engine/rank/quantized.py; "gguf": the file's Q4_0/Q4_1 blocks as
    # stored); None: the checkpoint's values in `dtype`
    weights: str | None = None

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
        """Raise ConfigError naming the first bad setting and its fix. Types are checked too
        (a bool is not an int, text is not a number): Hydra and kwargs pass values unconverted.
        A value of another type that means the same is turned into the field's own: a path, a
        torch dtype, numpy's integers and floats."""
        if isinstance(self.model, os.PathLike):  # a pathlib.Path names a checkpoint as well
            self.model = os.fspath(self.model)
        if isinstance(self.dtype, torch.dtype) and self.dtype in DTYPES.values():
            self.dtype = str(self.dtype).removeprefix("torch.")
        _require(isinstance(self.model, str) and self.model != "",
                 f"model={self.model!r}: name an alias, an HF-style directory or a .gguf file")
        for name in ("tp", "dp", "cp", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            setattr(self, name, _positive_int(name, getattr(self, name)))
        for name in ("max_model_len", "num_threads"):
            if (value := getattr(self, name)) is not None:
                setattr(self, name, _positive_int(name, value, "None (the default) or "))
        for name in ("init_timeout_s", "step_timeout_s", "collective_timeout_s"):
            setattr(self, name, _positive_number(name, getattr(self, name), "seconds"))
        for name in ("retry_on_rank_failure", "enable_prefix_caching", "overlap_comm",
                     "shared_memory_all_reduce"):
            _require(isinstance(getattr(self, name), bool),
                     f"{name}={getattr(self, name)!r}: use True or False")
        _require(self.compile is None or isinstance(self.compile, bool),
                 f"compile={self.compile!r}: use True, False or None (the engine decides)")
        for name in ("ray_address", "socket_ifname"):
            value = getattr(self, name)
            _require(value is None or isinstance(value, str), f"{name}={value!r}: use None or text")
        _require(self.routing in ROUTINGS,
                 f"routing={self.routing!r}: use one of {', '.join(map(repr, ROUTINGS))}")
        _require(self.executor in ("auto", "ray"),
                 f"executor={self.executor!r}: use 'auto' or 'ray'")
        _check_device(self.device)
        _require(self.dtype is None or (isinstance(self.dtype, str) and self.dtype in DTYPES),
                 f"dtype={self.dtype!r}: use one of {sorted(DTYPES)}")
        if self.kv_cache_gb is not None:
            self.kv_cache_gb = _positive_number("kv_cache_gb", self.kv_cache_gb, "GiB per rank")
            _check_memory(self.kv_cache_gb, self.device)
        for name, unit in (("kv_handle_ttl_s", "seconds"), ("cpus_per_rank", "CPUs, e.g. 0.5")):
            setattr(self, name, _positive_number(name, getattr(self, name), unit))
        _require(self.attention_backend in ("auto", "torch", "triton"),
                 f"attention_backend={self.attention_backend!r}: use 'auto', 'torch' or 'triton'")
        _require(self.kernel_choice in ("measure", "fixed"),
                 f"kernel_choice={self.kernel_choice!r}: use 'measure' (time the CPU kernels at "
                 f"start-up) or 'fixed' (the built-in choice)")
        if self.decode_dtype is not None:
            _check_decode_dtype(self)
        if self.cp > 1:
            _check_context_parallel(self)
        if self.weights is not None:
            _check_weights(self)


def _check_decode_dtype(cfg: EngineConfig) -> None:
    from engine.rank import gemm
    _require(cfg.decode_dtype == "bfloat16",
             f"decode_dtype={cfg.decode_dtype!r}: use None (the model's dtype) or 'bfloat16'")
    _require(cfg.device == "cpu" and cfg.torch_dtype == torch.float32,
             f"decode_dtype='bfloat16' with device={cfg.device!r}, dtype={cfg.dtype!r}: it gives "
             f"float32 models on a CPU bf16 decode weights; set dtype='bfloat16' instead")
    _require(gemm.HAVE_ONEDNN_BF16,
             "decode_dtype='bfloat16' needs oneDNN's bf16 products, which this torch build or "
             "this CPU lacks (they need AVX512 or AVX-NE-CONVERT; "
             f"{torch.backends.cpu.get_cpu_capability()} here); unset decode_dtype")


WEIGHTS = ("int8", "int4", "gguf")


def _check_weights(cfg: EngineConfig) -> None:
    name = f"weights={cfg.weights!r}"
    _require(isinstance(cfg.weights, str) and cfg.weights in WEIGHTS,
             f"{name}: use None (float weights), 'int8' (per channel), 'int4' (groups of 32) "
             f"or 'gguf' (a GGUF's Q4_0/Q4_1 projections as stored)")
    _require(cfg.device == "cpu",
             f"{name} with device={cfg.device!r}: quantized weights run on a CPU only so far; "
             f"use device='cpu' or weights=None")
    _require(cfg.torch_dtype in (torch.float32, torch.bfloat16),
             f"{name} with dtype={cfg.dtype!r}: the weight-only kernels take float32 or "
             f"bfloat16 activations; use dtype='float32' or 'bfloat16'")
    _require(cfg.decode_dtype is None,
             f"{name} with decode_dtype={cfg.decode_dtype!r}: decode already reads the "
             f"quantized weights; unset decode_dtype")


def _check_context_parallel(cfg: EngineConfig) -> None:
    """What cp > 1 does not support yet is refused here, by name, rather than run wrong."""
    _require(not cfg.enable_prefix_caching,
             f"enable_prefix_caching=True with cp={cfg.cp}: a cached prefix would be split over "
             f"the context ranks differently from the new prompt; set enable_prefix_caching=False")
    _require(not cfg.overlap_comm,
             f"overlap_comm=True with cp={cfg.cp}: not supported together; set one of them off")
    _require(cfg.compile is not True,
             f"compile=True with cp={cfg.cp}: context-parallel attention runs eagerly; set "
             f"compile=False")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _positive_int(name: str, value, also: str = "") -> int:
    """The value as an int (numpy's integers too; a bool is not one to us)."""
    integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    kind = "" if integral else f" is a {type(value).__name__}"
    _require(integral and value >= 1, f"{name}={value!r}{kind}: use {also}a positive integer")
    return int(value)


def _positive_number(name: str, value, unit: str) -> int | float:
    """The value as Python's int or float (numpy's numbers too)."""
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    _require(number, f"{name}={value!r} is a {type(value).__name__}: use a number of {unit}")
    _require(math.isfinite(value) and value > 0,
             f"{name}={value!r}: use a positive, finite number of {unit}")
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _check_device(device) -> None:
    ok = isinstance(device, str) and (device == "cpu" or re.fullmatch(r"cuda(:\d+)?", device))
    _require(bool(ok), f"device={device!r}: use 'cpu', 'cuda' or 'cuda:N'")
    if device == "cpu":
        return
    _require(torch.cuda.is_available(),
             f"device={device!r}, but CUDA is not available to this torch "
             f"({torch.__version__}); use device='cpu' or a CUDA build of torch on a GPU machine")
    index, count = int(device.partition(":")[2] or 0), torch.cuda.device_count()
    _require(index < count, f"device={device!r}: this machine has {count} CUDA device(s)")


def _memory_gib(device: str) -> float:
    """This machine's total memory for `device`: RAM for the CPU, the GPU's own for CUDA."""
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        return torch.cuda.get_device_properties(index).total_memory / 2**30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def _check_memory(kv_cache_gb: float, device: str) -> None:
    # checked against the driver's machine: ranks on other nodes are assumed alike; a cache that
    # large would be overcommitted and killed mid-request instead of refused here
    total = _memory_gib(device)
    _require(kv_cache_gb < total,
             f"kv_cache_gb={kv_cache_gb} per rank, but this machine has {total:.1f} GiB of "
             f"memory ({device}); use less, leaving room for the weights")
