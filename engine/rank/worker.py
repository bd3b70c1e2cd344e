"""One rank: its shard of the model, its slice of the paged KV cache, and the step it runs.

The same class runs in the driver's process (one rank) or inside a Ray actor (one per rank).
It builds everything from the driver's `EnginePlan` and derives nothing of its own."""
from __future__ import annotations

import os
import time

import torch
from torch import nn

from engine.batch import Batch, SamplingSpec, StepResult
from engine.errors import ModelLoadError
from engine.loading.checkpoint import Checkpoint, open_checkpoint
from engine.loading.weight_digest import Slices, WeightDigest
from engine.observe.tracer import OpTracer
from engine.plan import EnginePlan, RankInfo
from engine.rank.attention import StepContext
from engine.rank.backend import select_backend
from engine.rank.compiled import CompiledModel, warm_up
from engine.rank.decode_weights import DecodeWeights
from engine.rank.host_memory import keep_freed_memory
from engine.rank.kernels.launch_config import tuning_steps
from engine.rank.kernels.step_metadata import build_step_metadata
from engine.rank.kv_cache import KVCache
from engine.rank.model import CausalLM
from engine.rank.cp_runner import ContextParallelRunner, context_parallel_backend
from engine.rank.overlap import make_split_context
from engine.rank.sampler import sample
from engine.rank.prompt_logprobs import score_batch
from parallel import comm
from parallel.context import make_groups


class Sampler(nn.Module):
    """The next token of every row; a module so the tracer sees it as an op."""

    def forward(self, logits: torch.Tensor, specs: list[SamplingSpec]) -> list[int]:
        return sample(logits, specs)


class Worker:
    def __init__(self, plan: EnginePlan, rank: int = 0, world_size: int = 1,
                 checkpoint: Checkpoint | None = None, device: str | None = None):
        """`device`: where this rank computes; None: the plan's device type at index 0, the one
        GPU Ray shows a rank actor (the in-process executor passes the plan's own device)."""
        assert world_size == plan.world_size * plan.cp, (world_size, plan.world_size, plan.cp)
        if plan.num_threads:
            torch.set_num_threads(plan.num_threads)
        self.plan, self.rank = plan, rank
        self.device = indexed_device(device or torch.device(plan.device).type)
        if plan.on_cuda:
            torch.cuda.set_device(self.device)
        else:
            keep_freed_memory()
        self.shard = shard = plan.shard(rank % plan.world_size)  # rank in its TP group
        backend = select_backend(plan.backend, plan.device)
        # cp > 1: TP/CP sub-groups, and the split-by-position KV store and attention
        groups = make_groups(plan.world_size, plan.cp) if plan.cp > 1 else None
        if groups is not None:
            backend = context_parallel_backend(backend)
        self.model = CausalLM(plan.model, shard, plan.max_model_len, backend)
        # parameters go to their device and dtype before loading, so each checkpoint slice is
        # cast once on its way in; the rotary tables (buffers) stay float32
        for p in self.model.parameters():
            p.data = torch.empty_like(p.data, device=self.device, dtype=plan.dtype)
        self.model.to(self.device)
        started = time.perf_counter()
        self._load(checkpoint or open_checkpoint(plan.source))
        self.load_s = time.perf_counter() - started
        self.decode_weights = (DecodeWeights(self.model, plan.decode_dtype, packed=not plan.compile)
                               if plan.decode_dtype is not None else None)
        self.cache = KVCache(plan.model.num_layers, plan.num_blocks, plan.block_size,
                             shard.heads.num_kv_heads, plan.model.head_dim, plan.dtype, self.device)
        self.kv_head_of_q = mapping = shard.heads.kv_head_of_q_head()
        self.kv_head_of_q_device = torch.tensor(mapping, device=self.device)
        group = len(mapping) // shard.heads.num_kv_heads
        self.uniform_groups = mapping == [h // group for h in range(len(mapping))]
        self.sampler = Sampler()
        self.context = ContextParallelRunner(self, groups) if groups is not None else None
        self._tracer: OpTracer | None = None
        self.compiled: CompiledModel | None = None
        self.warmup_s = 0.0
        if plan.compile:
            self.compiled = CompiledModel(self.model, backend)
        if plan.compile or plan.backend == "triton":
            # on a GPU the flash prefill autotunes per token bucket: every bucket a step can
            # fall in is tuned here (under the interpreter it runs one tile: nothing to tune)
            tuning = (tuning_steps(plan.max_num_batched_tokens, plan.max_model_len)
                      if plan.on_cuda and plan.backend == "triton" else ())
            self.warmup_s = warm_up(self._warm_up_step, plan.max_model_len, self.compiled,
                                    tuning)
        if plan.on_cuda and self.compiled is not None and self.compiled.usable:
            start = time.perf_counter()
            self.compiled.capture_decode_graphs(self.cache, self.kv_head_of_q_device,
                                                plan.max_model_len)
            self.warmup_s += time.perf_counter() - start

    def _warm_up_step(self, num_tokens: int, start: int, num_seqs: int) -> None:
        """A step of `num_seqs` sequences of made-up tokens, all in the first blocks, which no
        request holds yet (their slots are overwritten when a request gets them). Every rank
        runs it at once (SPMD)."""
        positions = list(range(start, start + num_tokens)) * num_seqs
        blocks = list(range(-(-(start + num_tokens) // self.plan.block_size)))
        self.execute(Batch([0] * len(positions), positions,
                           list(range(0, len(positions) + 1, num_tokens)),
                           [start + num_tokens] * num_seqs, positions, [blocks] * num_seqs,
                           list(range(num_tokens - 1, len(positions), num_tokens)),
                           [SamplingSpec()] * num_seqs))

    def _load(self, ckpt: Checkpoint) -> None:
        """Every tensor the model needs, each exactly as expected, and no tensor left over;
        each slice is digested as it comes in (`weight_digest`)."""
        used: set[str] = set()
        self._digest = WeightDigest()

        def read(name, dim, start, stop):
            used.add(name)
            tensor = ckpt.read(name, dim, start, stop)
            if not torch.isfinite(tensor).all():
                raise ModelLoadError(f"{ckpt.source}: tensor {name} holds NaN or Inf values; "
                                     f"the checkpoint is corrupt")
            self._digest.add(name, dim, start, tensor)
            return tensor

        try:
            self.model.load(read)
        except ValueError as e:
            raise ModelLoadError(f"{ckpt.source}: {e}") from None
        extra = sorted(ckpt.names() - used)
        if extra:
            raise ModelLoadError(f"{ckpt.source}: {len(extra)} tensor(s) this architecture does not "
                                 f"use, e.g. {extra[:3]}; is config.json for another model?")

    def info(self) -> RankInfo:
        heads = self.shard.heads
        return RankInfo(self.rank, heads.q_heads, heads.kv_heads, self.shard.ffn, self.shard.vocab,
                        sum(p.numel() * p.element_size() for p in self.model.parameters())
                        + (self.decode_weights.nbytes if self.decode_weights else 0),
                        self.plan.kv_bytes_per_token(heads.num_kv_heads), self.cache.num_blocks,
                        self.cache.nbytes, os.getpid(),
                        self.compiled is not None and self.compiled.usable, self.warmup_s,
                        self.load_s, self._digest.seconds)

    def weight_digest(self) -> Slices:
        """The digests of every weight slice this rank loaded (the driver combines them)."""
        return self._digest.slices

    def execute(self, batch: Batch) -> StepResult | None:
        graph_rows = self._decode_graph_rows(batch)
        # one new token per sequence and nothing scored: a decode step; compiled, only the
        # decode graph reads the copies (the layers graph was compiled for the model's own)
        decode = _one_token_rows(batch)
        if self.compiled is not None and self.compiled.active:
            decode = graph_rows is not None
        if self.decode_weights is not None and decode:
            with self.decode_weights.active():
                return self._execute(batch, graph_rows)
        return self._execute(batch, graph_rows)

    def _execute(self, batch: Batch, graph_rows: int | None) -> StepResult | None:
        if self.context is not None:
            return self.context.execute(batch)
        started = self.step_clocks()
        if graph_rows is not None:
            logits, score = self._decode_graph_logits(batch, graph_rows), None
            graph = f"decode-{graph_rows}"
        else:
            ctx = self._step_context(batch)
            tokens, positions, indices = self._step_inputs(batch, ctx)
            x, residual, graph = self._hidden_states(tokens, positions, ctx)
            logits = self.model.logits(x, residual, indices)
            score = score_batch(self.model, x, residual, batch)  # None unless it scores rows
        result = self.step_result(started, score)
        if result is None:
            return None
        result.graph = graph
        if logits is not None:  # None: every sequence is mid-prompt, nothing to sample
            self._sample(logits.cpu(), batch, result)
        return result

    def _step_context(self, batch: Batch):
        """The step's metadata and inputs, on the device in one copy, read by every layer (two
        halves' worth when the step overlaps its all-reduces with compute)."""
        if self.plan.overlap_comm and self.plan.world_size > 1 and batch.num_tokens >= 2:
            return make_split_context(batch, self.cache, self.kv_head_of_q, self.device,
                                      self.uniform_groups)
        inputs = {"token_ids": batch.token_ids, "positions": batch.positions,
                  "logits_indices": batch.logits_indices}
        return StepContext(self.cache, build_step_metadata(
            batch.cu_seqlens_q, batch.context_lens, batch.block_tables, batch.slot_mapping,
            self.kv_head_of_q, self.device, uniform_groups=self.uniform_groups, inputs=inputs))

    def _step_inputs(self, batch: Batch, ctx) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token ids, positions, logits rows) on the device: the views packed with the step's
        metadata, or (a split step's) copies of their own."""
        meta = getattr(ctx, "meta", None)
        if getattr(meta, "token_ids", None) is not None:
            return meta.token_ids, meta.positions, meta.logits_indices
        return (torch.tensor(batch.token_ids, device=self.device),
                torch.tensor(batch.positions, device=self.device),
                torch.tensor(batch.logits_indices, device=self.device, dtype=torch.long))

    def _decode_graph_rows(self, batch: Batch) -> int | None:
        """The compiled decode graph's row count for this step; None: not a step it runs."""
        if self.compiled is None or not self.compiled.active or not _one_token_rows(batch):
            return None
        return self.compiled.decode_bucket(batch.num_seqs)

    def _decode_graph_logits(self, batch: Batch, rows: int) -> torch.Tensor | None:
        local = self.compiled.decode_logits(batch, self.cache, self.kv_head_of_q_device, rows)
        if not batch.logits_indices:  # every rank sees the same batch: all skip the gather
            return None
        # a decode step samples every sequence, i.e. the graph's first rows: no index copy
        if batch.logits_indices == list(range(len(batch.logits_indices))):
            local = local[:len(batch.logits_indices)]
        else:
            local = local[torch.tensor(batch.logits_indices, device=self.device)]
        logits = self.model.lm_head.gather(local)
        return None if logits is None else logits.float()

    def _hidden_states(self, token_ids: torch.Tensor, positions: torch.Tensor, ctx):
        """(hidden, residual, the graph that ran them: "" when eager)."""
        if (self.compiled is not None and self.compiled.runs_layers(len(token_ids))
                and isinstance(ctx, StepContext)):
            return *self.compiled.hidden_states(token_ids, positions, ctx), "layers"
        return *self.model.hidden_states(token_ids, positions, ctx), ""

    @staticmethod
    def step_clocks() -> tuple[float, float, float]:
        """Host time, exposed and total collective seconds now: a step's starting marks."""
        return time.perf_counter(), comm.CLOCK.seconds, comm.CLOCK.busy_seconds

    def step_result(self, started: tuple[float, float, float],
                    score=None) -> StepResult | None:
        """Rank 0's result for a step begun at `started` (from `step_clocks`): the forward's time
        and its exposed and total collective time; None on the other ranks."""
        if self.rank != 0:  # only rank 0 answers: the others queue the next step at once
            comm.CLOCK.discard()
            return None
        if self.plan.on_cuda:  # the timers read host time: let the device catch up first
            torch.cuda.synchronize(self.device)
        comm.CLOCK.settle()
        start, exposed, busy = started
        result = StepResult([], None, time.perf_counter() - start, comm.CLOCK.seconds - exposed,
                            score=score)
        result.comm_total_s = comm.CLOCK.busy_seconds - busy
        return result

    def _sample(self, logits: torch.Tensor, batch: Batch, result: StepResult) -> None:
        """Fill `result` with one token per row. A row of NaN/Inf would "sample" garbage: it is
        flagged and sampled from a safe stand-in, so one bad request fails alone."""
        start = time.perf_counter()
        result.nonfinite_rows = (~torch.isfinite(logits).all(-1)).nonzero().flatten().tolist()
        safe = logits.nan_to_num(0.0, 0.0, 0.0) if result.nonfinite_rows else logits
        try:
            result.token_ids = self.sampler(safe, batch.sampling)
        except Exception:  # noqa: BLE001  one request's settings: find it, spare the others
            result.token_ids = [self._sample_row(safe, i, spec, result)
                                for i, spec in enumerate(batch.sampling)]
        result.logits = logits if batch.return_logits else None
        result.sample_s = time.perf_counter() - start

    @staticmethod
    def _sample_row(logits: torch.Tensor, row: int, spec: SamplingSpec, result: StepResult) -> int:
        try:
            return sample(logits[row:row + 1], [spec])[0]
        except Exception as e:  # noqa: BLE001  reported to the driver as this request's failure
            result.row_errors[row] = f"{type(e).__name__}: {e}"
            return 0

    def memory(self) -> dict:
        """This rank's resident memory (CPU) or peak allocated memory (CUDA), in bytes."""
        if self.plan.on_cuda:
            return {"rank": self.rank, "resident_bytes": torch.cuda.max_memory_allocated(self.device)}
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return {"rank": self.rank, "resident_bytes": pages * os.sysconf("SC_PAGE_SIZE")}

    def start_tracing(self) -> None:
        if self.compiled is not None:  # the tracer's hooks observe the eager model
            self.compiled.enabled = False
        self._tracer = OpTracer(self.rank, self.device, {"": self.model, "sampler": self.sampler})
        self._tracer.__enter__()

    def stop_tracing(self) -> list[dict]:
        """Every op this rank ran since start_tracing, with shapes, FLOPs, bytes and time."""
        tracer, self._tracer = self._tracer, None
        if tracer is None:
            return []
        tracer.__exit__(None, None, None)
        if self.compiled is not None:
            self.compiled.enabled = True
        return [r.to_dict() for r in tracer.records]

    def read_kv(self, layer: int, block_table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's K/V of one sequence ([length, local kv heads, d]), for inspection."""
        if self.context is not None:  # cp > 1: the positions this rank holds, in order
            return self.context.read_kv(layer, block_table, length)
        k, v = self.cache.gather(layer, block_table, length)
        return k.cpu(), v.cpu()


def indexed_device(device: str) -> torch.device:
    """`device` with an index on CUDA: torch.cuda.set_device refuses a bare "cuda", and a
    bare one elsewhere would mean "the current device", whatever another thread set."""
    dev = torch.device(device)
    return torch.device("cuda", dev.index or 0) if dev.type == "cuda" else dev


def _one_token_rows(batch: Batch) -> bool:
    """Every sequence brings one new token and nothing is scored: a decode step's shape."""
    return batch.num_tokens == batch.num_seqs and not batch.score_indices
