"""What the driver resolves once and every rank is told: the plan of one replica.

The settings say what the user asked for; the plan is what follows from them and the checkpoint
(context length, dtype, the attention backend, how heads, FFN and vocabulary split over ranks,
how many KV blocks fit). Ranks build from the plan and never re-derive any of it, so the driver
and every rank agree by construction.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

from engine.config import DTYPES, EngineConfig
from engine.errors import ConfigError
from engine.loading.model_config import ModelConfig
from parallel.cp_layout import max_held
from parallel import comm
from parallel.partition import HeadPartition, Range, even_ranges, partition_heads


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """What one rank owns of every layer."""

    rank: int
    world_size: int
    heads: HeadPartition
    ffn: Range
    vocab_ranges: list[Range]

    @property
    def vocab(self) -> Range:
        return self.vocab_ranges[self.rank]


@dataclass(frozen=True, slots=True)
class EnginePlan:
    source: str  # the checkpoint every rank opens
    model: ModelConfig
    world_size: int
    device: str
    dtype: torch.dtype
    backend: str  # "torch" or "triton", already checked to work here
    max_model_len: int
    block_size: int
    num_blocks: int  # per rank; every rank holds the same number
    num_threads: int | None
    compile: bool
    heads: list[HeadPartition]
    ffn: list[Range]
    vocab: list[Range]
    overlap_comm: bool = False  # split each multi-token step in two, all-reduces overlapped
    cp: int = 1  # context-parallel ranks; a replica is world_size (TP) x cp rank actors
    decode_dtype: torch.dtype | None = None  # weights decode steps read, if not the model's
    max_num_batched_tokens: int = 8192  # the most tokens one step holds (the scheduler's budget)
    measure_kernels: bool = False  # a CPU rank times its kernels at start-up (kernel_choice)
    # compile=True, one rank, kernel_choice="measure": steps timed through the graphs and
    # eagerly after the warm-up, each kind run the faster way (Worker._timed_graph_kinds)
    time_graph_steps: bool = False
    # compile unset on a CPU: a rank whose kept step timings say every kind runs faster without
    # graphs builds none (Worker._compiled_model)
    graphs_optional: bool = False
    weights: str | None = None  # "int8" | "int4" | "gguf": quantized projections (quantized.py)
    shared_memory_all_reduce: bool = True  # CPU ranks on one machine sum through shared memory

    @property
    def on_cuda(self) -> bool:
        return comm.is_cuda(self.device)

    def shard(self, rank: int) -> ShardPlan:
        return ShardPlan(rank, self.world_size, self.heads[rank], self.ffn[rank], self.vocab)

    def kv_bytes_per_token(self, kv_heads: int) -> int:
        return 2 * self.model.num_layers * kv_heads * self.model.head_dim * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class RankInfo:
    """One rank as built: its slices, its memory, its process."""

    rank: int
    q_heads: Range
    kv_heads: Range
    ffn: Range
    vocab: Range
    weight_bytes: int
    kv_bytes_per_token: int
    num_blocks: int
    kv_cache_bytes: int
    pid: int
    compiled: bool  # running torch.compile'd layers (False: eager, asked for or fallen back)
    warmup_s: float  # compilation at start-up
    load_s: float  # reading the weights, digest included
    weight_digest_s: float  # of load_s: digesting them (engine/loading/weight_digest.py)
    kernels: list[str]  # the CPU kernels timed and picked per shape (engine.rank.kernel_choice)
    kernel_choice_s: float  # start-up seconds spent timing them (~0 when kept on disk)
    huge_page_bytes: int  # of the weights, moved onto transparent huge pages (CPU; host_memory)
    all_reduce: str  # how the layers' all-reduce runs here (TensorGroup.all_reduce_kind)

    def to_dict(self) -> dict:
        return asdict(self)


CPU_KV_CACHE_BYTES = 2**29  # 0.5 GiB per rank when kv_cache_gb is unset on a CPU
GPU_HEADROOM = 0.15  # of the GPU memory free after the weights: activations, allocator slack


def kv_pool_bytes(kv_cache_gb: float | None, on_cuda: bool, free_bytes: int,
                  weight_bytes: int) -> int:
    """Bytes of KV cache per rank: as set, else 0.5 GiB on a CPU, else on CUDA the memory the
    GPU has free once this rank's weights are in, less GPU_HEADROOM of it."""
    if kv_cache_gb is not None:
        return int(kv_cache_gb * 2**30)
    if not on_cuda:
        return CPU_KV_CACHE_BYTES
    left = free_bytes - weight_bytes
    if left <= 0:
        raise ConfigError(f"the GPU has {free_bytes / 2**30:.1f} GiB free, less than this rank's "
                          f"{weight_bytes / 2**30:.1f} GiB of weights; use more ranks (tp) or a "
                          f"smaller model")
    return int(left * (1 - GPU_HEADROOM))


def _free_gpu_bytes(device: str) -> int:
    """Free memory of the driver's GPU; ranks on other GPUs are assumed alike."""
    return torch.cuda.mem_get_info(torch.device(device))[0]


def make_plan(cfg: EngineConfig, source: str, mc: ModelConfig) -> EnginePlan:
    """Resolve the settings against the model once; a setting that cannot work fails here."""
    from engine.rank.backend import resolve_backend
    from engine.rank.quantized import check_int4_shapes

    try:
        heads = partition_heads(mc.num_heads, mc.num_kv_heads, cfg.tp)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    backend = resolve_backend(cfg.attention_backend, cfg.device)
    max_model_len = cfg.max_model_len or mc.max_position_embeddings
    if max_model_len > mc.max_position_embeddings:
        raise ConfigError(f"max_model_len={cfg.max_model_len} exceeds the model's context of "
                          f"{mc.max_position_embeddings} tokens; use at most that")
    if cfg.cp > 1 and cfg.max_num_batched_tokens < max_model_len:
        raise ConfigError(
            f"max_num_batched_tokens={cfg.max_num_batched_tokens} with cp={cfg.cp}: context "
            f"parallelism prefills whole prompts only (no chunked prefill), so a step must hold "
            f"the longest prompt; raise it to max_model_len={max_model_len} or lower max_model_len")
    num_blocks = _num_blocks(cfg, mc, heads, max_model_len)
    plan = EnginePlan(source, mc, cfg.tp, cfg.device, cfg.torch_dtype, backend, max_model_len,
                      cfg.block_size, num_blocks, cfg.num_threads,
                      compiles(cfg),
                      heads,
                      even_ranges(mc.intermediate_size, cfg.tp), even_ranges(mc.vocab_size, cfg.tp),
                      overlap_comm=cfg.overlap_comm, cp=cfg.cp,
                      decode_dtype=DTYPES.get(cfg.decode_dtype),
                      max_num_batched_tokens=cfg.max_num_batched_tokens, weights=cfg.weights,
                      shared_memory_all_reduce=cfg.shared_memory_all_reduce,
                      measure_kernels=cfg.kernel_choice == "measure" and cfg.device == "cpu",
                      time_graph_steps=(compiles(cfg) and cfg.kernel_choice == "measure"
                                        and cfg.tp == cfg.cp == 1),
                      graphs_optional=cfg.compile is None and cfg.device == "cpu")
    if cfg.weights in ("int4", "gguf"):
        check_int4_shapes(plan)
    return plan


COMPILE_ENV = "PREFILL_ENGINE_COMPILE"  # "0": compile unset means eager on a CPU


def compiles(cfg: EngineConfig) -> bool:
    """compile=True/False as set. Unset: on for CUDA (with cp = 1: context parallelism runs
    eagerly), and on a CPU for a one-rank engine that times its kernels, in float32 and in
    bfloat16 where oneDNN multiplies bf16 (AMX or AVX512-BF16); the rank then times each kind
    of step through its graphs and eagerly and runs it the faster way (kernel_choice's
    graph-prompt / graph-decode), so the graphs only cost start-up where they do not help.
    float32 compiles since decode graphs stream one-row products 1.7x as fast as eager on the
    AVX512 EPYC (41.9 against 24.2 tok/s: `python -m bench.peers --systems engine
    engine-compile --dtypes float32`), and its warm start took 8 s there. A bf16 engine on an
    AVX2-only CPU stays eager, as before (its graphs prefilled 512 tokens slower there). Quantized weights (weights=...)
    follow the same rule (eager dequantizes a prompt's weights op by op). A cold start compiles
    (about a minute for SmolLM2 on 2 cores) and keeps the graphs on disk for later starts
    (engine.rank.kept_graphs); where the step timings a start keeps say every kind ran faster
    without the graphs, later starts build none (Worker._compiled_model).
    $PREFILL_ENGINE_COMPILE=0 keeps every CPU engine whose compile is unset eager: quick
    starts, as the test suite wants."""
    if cfg.compile is not None:
        return cfg.compile
    if cfg.device != "cpu":
        return cfg.cp == 1
    if _compile_unset_means_eager():
        return False
    from engine.rank import gemm

    dtype_compiles = cfg.torch_dtype == torch.float32 or (
        cfg.torch_dtype == torch.bfloat16 and gemm.HAVE_ONEDNN_BF16)
    return dtype_compiles and cfg.tp == cfg.cp == 1 and cfg.kernel_choice == "measure"


def _compile_unset_means_eager() -> bool:
    value = os.environ.get(COMPILE_ENV, "")
    if value not in ("", "0"):
        raise ConfigError(f"{COMPILE_ENV}={value!r}: set it to 0 (a CPU engine whose compile is "
                          f"unset runs eagerly) or unset it (the engine decides)")
    return value == "0"


def _num_blocks(cfg: EngineConfig, mc: ModelConfig, heads: list[HeadPartition],
                max_model_len: int) -> int:
    """KV blocks per rank: as many as the rank with the most KV heads can hold, and at least one
    request of max_model_len, of which a context rank keeps only its slice (cp_layout)."""

    widest = max(h.num_kv_heads for h in heads)
    dtype = cfg.torch_dtype
    bytes_per_block = 2 * mc.num_layers * widest * mc.head_dim * dtype.itemsize * cfg.block_size
    on_cuda = comm.is_cuda(cfg.device)
    weight_bytes = mc.num_params * dtype.itemsize // cfg.tp
    pool = kv_pool_bytes(cfg.kv_cache_gb, on_cuda,
                         _free_gpu_bytes(cfg.device) if on_cuda and cfg.kv_cache_gb is None else 0,
                         weight_bytes)
    num_blocks = pool // bytes_per_block
    held = max_held(max_model_len, cfg.cp)
    needed = -(-held // cfg.block_size)
    if num_blocks < needed:
        sliced = f", of which one of cp={cfg.cp} ranks keeps at most {held}" if cfg.cp > 1 else ""
        raise ConfigError(
            f"kv_cache_gb={pool / 2**30:.3g} holds {num_blocks} blocks of {cfg.block_size} tokens "
            f"({num_blocks * cfg.block_size} tokens at {bytes_per_block // cfg.block_size} bytes "
            f"per token per rank), less than one request of max_model_len={max_model_len}"
            f"{sliced} ({needed} blocks); raise kv_cache_gb or lower max_model_len")
    return num_blocks
