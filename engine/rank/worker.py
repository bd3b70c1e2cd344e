"""One rank: its shard of the model, its slice of the paged KV cache, and the step it runs.

The same class runs in the driver's process (one rank) or inside a Ray actor (one per rank).
It builds everything from the driver's `EnginePlan` and derives nothing of its own."""
from __future__ import annotations

import os
import time
import weakref
from functools import partial

import torch

from engine.batch import Batch, StepResult
from engine.loading.checkpoint import Checkpoint, open_checkpoint
from engine.loading.load_weights import load_weights
from engine.loading.weight_digest import Slices
from engine.observe.step_timer import StepTimer
from engine.observe.tracer import OpTracer
from engine.plan import EnginePlan, RankInfo
from engine.rank.backend import select_backend
from engine.rank.compiled import DECODE_BUCKETS, CompiledModel
from engine.rank.context_parallel import ContextParallelSteps, context_parallel_backend
from engine.rank.decode_weights import decode_view
from engine.rank import gemm
from engine.rank.host_memory import back_with_huge_pages, keep_freed_memory
from engine.rank.kernels.launch_config import tuning_steps
from engine.rank.kernel_choice import (STREAMED_ROWS, KernelChoice, machine_key,
                                      projection_weights)
from engine.rank.kv_cache import KVCache
from engine.rank.model import CausalLM
from engine.rank.overlap import with_halves
from engine.rank.prompt_logprobs import score_batch
from engine.rank.padded_decode import pad_decode_step
from engine.rank.quantized import quantize_model, quantized_weights
from engine.rank.quantized_layers import DecodeLayersCall, float_unfit_reason, unfit_reason
from engine.rank.sampler import Sampler, sample_into
from engine.rank.step_context import DECODE, StepContext, step_mode
from engine.rank.step_metadata import build_step_metadata
from engine.rank.warmup import warm_up, warm_up_batch
from parallel.comm import TensorGroup
from parallel.context import make_groups

# compile=True on a CPU: a prompt of this many tokens, and a decode step after this many, time
# each kind's graphs against eager (Worker._choose_graph_steps). A GPU's prompt: more tokens,
# where a prompt's time is its matmuls, not its launches (the first H200 check: graphs 0.77x
# and 0.82x as fast as eager at 1k and 8k tokens of Llama-3-8B's layers)
GRAPH_TIMING_TOKENS = 256
GPU_GRAPH_TIMING_TOKENS = 2048
LAYERS_CALL = "layers-call"  # a StepContext's `graph`: DecodeLayersCall runs its layers
ONE_CALL = "one-call"  # a decode step's way (graph-decode): the layers in one C++ call
PART_CALLS = "part-calls"  # a TP rank's decode step's way (decode-steps): a C++ call per part


class Worker:
    """One rank's model runner: built from the plan, then `execute(batch)` once per step."""

    def __init__(self, plan: EnginePlan, rank: int = 0, world_size: int = 1,
                 checkpoint: Checkpoint | None = None, device: str | None = None):
        """`device`: where this rank computes; None: the plan's device type at index 0, the one
        GPU Ray shows a rank actor (an in-process rank passes the plan's own device)."""
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
        self.backend = select_backend(plan.backend, plan.device)
        # cp > 1: TP/CP sub-groups, and the split-by-position KV store and attention
        groups = make_groups(plan.world_size, plan.cp) if plan.cp > 1 else None
        if groups is not None:
            self.backend = context_parallel_backend(self.backend)
        self.tp = groups.tensor if groups is not None else TensorGroup()
        if plan.shared_memory_all_reduce and not plan.on_cuda:
            self.tp.share_memory()
        self.kernels = KernelChoice(plan.dtype)  # filled by measure(); fixed choices until then
        if not plan.on_cuda:
            self.backend = self.kernels.applied_to(self.backend)
        self.model = CausalLM(plan.model, shard, plan.max_model_len, self.backend, self.tp)
        started = time.perf_counter()
        checkpoint = checkpoint or open_checkpoint(plan.source)
        self.digest = load_weights(self.model, checkpoint, self.device, plan.dtype)
        # weights=...: the projections' float weights are replaced (counted in info() apart)
        self.quantized_bytes = (quantize_model(self.model, plan.weights, checkpoint)
                                if plan.weights is not None else 0)
        self.load_s = time.perf_counter() - started
        self.kernel_choice_s = self._measure_kernels() if plan.measure_kernels else 0.0
        # weights=...: decode steps' layers in one C++ call (engine.rank.quantized_layers)
        self.layers_call, self._layers_call_note = self._quantized_decode()
        self.decode_model, self.decode_bytes = self._decode_view()
        self.prompt_copy_bytes = self._make_prompt_copies()
        self.huge_page_bytes = 0 if plan.on_cuda else back_with_huge_pages(self._decode_tensors())
        self.cache = KVCache(plan.model.num_layers, plan.num_blocks, plan.block_size,
                             shard.heads.num_kv_heads, plan.model.head_dim, plan.dtype, self.device)
        self.kv_head_of_q = mapping = shard.heads.kv_head_of_q_head()
        self.kv_head_of_q_device = torch.tensor(mapping, device=self.device)
        group = len(mapping) // shard.heads.num_kv_heads
        self.uniform_groups = mapping == [h // group for h in range(len(mapping))]
        self.sampler = Sampler()
        self.context = (ContextParallelSteps(groups, self.backend, self.kv_head_of_q_device,
                                             plan.block_size, plan.model.vocab_size)
                        if groups is not None else None)
        self._tracer: OpTracer | None = None
        self._decode_timed = False  # a graph timing, run or kept, chose how decode steps run
        self._graphs_note = ""
        self.compiled = self._compiled_model()
        self.warmup_s = self._warm_up()
        if not self._decode_timed:
            self._choose_decode_call()  # else the graph timing offered the call

    def _measure_kernels(self) -> float:
        started, heads = time.perf_counter(), self.shard.heads
        gate_up = self.model.layers[0].mlp.gate_up_proj.weight
        self.kernels.measure(projection_weights(self.model),
                             (heads.num_q_heads, heads.num_kv_heads, self.plan.model.head_dim),
                             self.plan.max_num_batched_tokens,
                             lm_head_shape=tuple(self.model.lm_head.weight.shape),
                             max_context=self.plan.max_model_len,
                             gate_up_shape=tuple(gate_up.shape))
        self.kernels.choose_quantized_rows(quantized_weights(self.model))
        if self.plan.compile:
            self.kernels.choose_graph_rows(projection_weights(self.model))
            if self.plan.cp == 1:  # context parallel attends through its own ops
                self.kernels.choose_graph_decode_attention(
                    (heads.num_q_heads, heads.num_kv_heads, self.plan.model.head_dim),
                    heads.kv_head_of_q_head(), self.plan.block_size, self.plan.max_model_len)
        return time.perf_counter() - started

    def _quantized_decode(self) -> tuple[DecodeLayersCall | None, str]:
        """The runner of a quantized decode step's layers in one call, where this rank can run
        it, and what rank_info says of it."""
        plan = self.plan
        if plan.weights is None or plan.on_cuda or plan.cp > 1:
            return None, ""
        reason = self._on_every_rank(unfit_reason(self.model, self.kernels.quantized_rows_seconds,
                                                  self.shard.heads.kv_head_of_q_head()))
        if reason is not None:
            return None, f"quantized-decode-layers: off ({reason})"
        calls = ("one C++ call a step" if plan.world_size == 1
                 else "a C++ call per layer part, all-reduced between")
        return DecodeLayersCall(self.model), f"quantized-decode-layers: {calls}"

    def _graph_key(self) -> str | None:
        """What this rank's compiled graphs depend on besides their code and tensor inputs,
        to keep them on disk under (engine.rank.kept_graphs); None on a GPU, whose graphs
        every start compiles."""
        return None if self.plan.on_cuda else self._setup_key()

    def _setup_key(self) -> str:
        """The machine (the CPU, or the GPU's name) and every setting a step depends on."""
        plan = self.plan
        # (a timing's key names the CPU and torch already: engine.rank.kernel_choice)
        where = torch.cuda.get_device_name(self.device) if plan.on_cuda else machine_key()
        return (f"{where}|{plan.model!r}|{self.shard!r} cp={plan.cp}|dtype={plan.dtype} "
                f"decode_dtype={plan.decode_dtype} weights={plan.weights} backend={plan.backend} "
                f"block={plan.block_size} max_len={plan.max_model_len} "
                f"overlap={plan.overlap_comm} "
                f"graph_rows_torch={self.kernels.graph_rows_call_torch} "
                f"fused_decode={self.kernels.graph_decode_fused} "
                f"gated={self.kernels.gated_prompt_shape} "
                f"quantized_rows={sorted(self.kernels.quantized_rows_shapes)}")

    def _decode_view(self) -> tuple[torch.nn.Module | None, int]:
        """The model view decode steps run (engine.rank.decode_weights): decode_dtype copies,
        or packed copies of the weights measured faster so; (None, 0): decode runs the model."""
        plan = self.plan
        if plan.decode_dtype is not None:
            return decode_view(self.model, self.tp, plan.decode_dtype, packed=not plan.compile)
        # with compile=True only where decode steps may run eagerly: a rank that times its
        # decode graphs against them (_choose_graph_steps)
        if self.kernels.packed_decode_shapes and (not plan.compile
                                                  or "decode" in self._timed_graph_kinds):
            return decode_view(self.model, self.tp, plan.dtype,
                               shapes=self.kernels.packed_decode_shapes)
        return None, 0

    def _decode_tensors(self) -> list[torch.Tensor]:
        """Every tensor a decode step reads besides the KV cache: the model's, its decode
        view's, and quantized weights' codes and scales (weights=..., not module tensors)."""
        views = [self.model] if self.decode_model is None else [self.model, self.decode_model]
        quantized = [t for w in quantized_weights(self.model) for t in w.tensors()]
        return [t for view in views for t in (*view.parameters(), *view.buffers())] + quantized

    def _make_prompt_copies(self) -> int:
        """Packed copies of the projections whose shapes KernelChoice timed faster so for a
        prompt's rows (engine.rank.gemm.PromptCopies), dropped with the model; their bytes."""
        shapes, head = self.kernels.packed_prompt_shapes, self.model.lm_head.weight
        weights = [w for w in projection_weights(self.model)
                   if tuple(w.shape) in shapes and w is not head]
        if not weights:
            return 0
        weakref.finalize(self.model, gemm.PROMPT_COPIES.remove, [w.data_ptr() for w in weights])
        # gate/up weights whose prompts fuse the SiLU·mul (KernelChoice.gated_linear): halves
        gate_ups = [layer.mlp.gate_up_proj for layer in self.model.layers]
        gated = {id(p.weight) for p in gate_ups if p.bias is None
                 and tuple(p.weight.shape) == self.kernels.gated_prompt_shape}
        rows = self.kernels.prompt_copy_rows
        return (gemm.PROMPT_COPIES.add([w for w in weights if id(w) not in gated], rows)
                + gemm.PROMPT_COPIES.add([w for w in weights if id(w) in gated], rows, halves=True))

    def _compiled_model(self) -> CompiledModel | None:
        """The rank's graphs (compile=True), built unless compile was unset and the step
        timings an earlier start kept say no kind of step runs faster through them: then each
        kind runs the way kept, and the start skips compiling or loading graphs (SmolLM2 on
        the Zen 5 EPYC: 3 s against 8 in float32, 2 against 7 in bf16; BENCHMARKS.md)."""
        plan = self.plan
        if not plan.compile or (plan.graphs_optional and self._took_kept_eager_steps()):
            return None
        # graphs read decode_dtype copies, never packed ones (oneDNN's opaque layout)
        return CompiledModel(self.model, self.decode_model if plan.decode_dtype else None,
                             self._graph_key(), self.kernels.graph_decode_fused)

    def _took_kept_eager_steps(self) -> bool:
        kinds = self._timed_graph_kinds
        if not kinds:
            return False
        steps, setup, layers_call = self._graph_step_timing(kinds)
        ways = self.kernels.kept_eager_steps(steps, self._model_shape(), setup)
        if ways is None:
            return False
        self._take_step_ways(ways, layers_call)
        self._graphs_note = ("graphs: none built (the step timings kept on disk: every kind "
                             "ran faster without them; compile=True builds them)")
        return True

    def _warm_up(self) -> float:
        """Compile (compile=True) and tune (Triton on a GPU) at start-up; seconds taken."""
        plan = self.plan
        if self.compiled is None and plan.backend != "triton":
            return 0.0
        # on a GPU the flash prefill autotunes per token bucket: every bucket a step can fall
        # in is tuned here (under the interpreter it runs one tile: nothing to tune)
        tuning = (tuning_steps(plan.max_num_batched_tokens, plan.max_model_len)
                  if plan.on_cuda and plan.backend == "triton" else ())
        # a one-rank CPU engine compiles the decode graph of one row, times it against eager,
        # and compiles the other buckets only if the graphs won (engine.rank.compiled)
        kinds = self._timed_graph_kinds
        seconds = warm_up(self.execute, plan.block_size, plan.max_model_len, self.compiled,
                          tuning, DECODE_BUCKETS[:1] if "decode" in kinds else DECODE_BUCKETS)
        if plan.on_cuda and self.compiled is not None and self.compiled.usable:
            start = time.perf_counter()
            self.compiled.capture_decode_graphs(self.cache, self.kv_head_of_q_device,
                                                plan.max_model_len, self.decode_model is not None)
            seconds += time.perf_counter() - start
        if kinds and self.compiled is not None and self.compiled.usable:
            start = time.perf_counter()
            self._choose_graph_steps(kinds)
            self.kernel_choice_s += time.perf_counter() - start
            if "decode" in kinds and self.compiled.graph_steps["decode"]:
                seconds += warm_up(self.execute, plan.block_size, plan.max_model_len,
                                   self.compiled, (), DECODE_BUCKETS[1:])
        return seconds

    @property
    def _timed_graph_kinds(self) -> tuple[str, ...]:
        """The kinds of step that run through their graphs or eagerly, as timed after the
        warm-up (plan.time_graph_steps: compile=True on one rank; ranks that chose apart would
        run differently padded rows into the same all-reduce). A CPU rank times prompts and
        decode steps; a GPU rank its prompts: its decode steps replay CUDA graphs, whose point
        is the launches an eager decode step makes."""
        if not self.plan.time_graph_steps:
            return ()
        if self.layers_call is not None:  # decode steps never run the graphs
            return ("prompt",)
        return ("prompt",) if self.plan.on_cuda else ("prompt", "decode")

    def _choose_graph_steps(self, kinds: tuple[str, ...]) -> None:
        """Time a step of each kind through its graphs and eagerly, and a float model's decode
        step as one C++ call where its layers take it; each kind runs the fastest way
        (KernelChoice.choose_graph_steps; a prompt runs eagerly unless its graph is 2 % faster,
        a decode step as the one call unless another way is 10 % faster). A step returns its
        sampled token to the host, so on a GPU too it has finished when it returns."""
        steps, setup, layers_call = self._graph_step_timing(kinds)
        ways = self.kernels.choose_graph_steps(steps, self._model_shape(), setup)
        for kind, way in ways.items():
            self.compiled.graph_steps[kind] = way == "graph"
        self._take_step_ways(ways, layers_call)

    def _graph_step_timing(self, kinds: tuple[str, ...]
                           ) -> tuple[dict, str, DecodeLayersCall | None]:
        """Each kind's timed step (its rows, a run of it each way, the way kept unless another
        is faster), what the timings depend on beside the model's shape, and the float decode
        call where it is one of the ways."""
        plan = self.plan
        most = GPU_GRAPH_TIMING_TOKENS if plan.on_cuda else GRAPH_TIMING_TOKENS
        tokens = min(most, plan.max_num_batched_tokens, plan.max_model_len - 1)
        context = min(GRAPH_TIMING_TOKENS, plan.max_model_len - 1)
        batches = {"prompt": warm_up_batch(tokens, 0, 1, plan.block_size),
                   "decode": warm_up_batch(1, context, 1, plan.block_size)}
        layers_call = self._float_layers_call() if "decode" in kinds else None

        def run(kind: str, way: str) -> None:
            self.compiled.graph_steps[kind] = way == "graph"
            if layers_call is not None:  # else a quantized model's call stays as it is
                self.layers_call = layers_call if way == ONE_CALL else None
            self.execute(batches[kind])

        steps = {}
        for kind in kinds:
            ways = ("graph", "eager") + ((ONE_CALL,) if kind == "decode" and layers_call else ())
            built_in = "eager" if kind == "prompt" else ONE_CALL if ONE_CALL in ways else "graph"
            steps[kind] = (batches[kind].num_tokens, {way: partial(run, kind, way) for way in ways},
                           built_in)
        return steps, self._step_setup(context), layers_call

    def _step_setup(self, context: int) -> str:
        """What a timed step's speed depends on beside the model's shape: the settings and
        graphs, the timed context, and the packed copies its eager decode products read."""
        return (f"{self._setup_key()} context={context} "
                f"packed={sorted(self.kernels.packed_decode_shapes)}")

    def _take_step_ways(self, ways: dict[str, str], layers_call: DecodeLayersCall | None) -> None:
        """Decode steps run as the graph timing chose (the graphs' own switches aside)."""
        if layers_call is not None:
            self.layers_call = layers_call if ways["decode"] == ONE_CALL else None
        self._decode_timed = "decode" in ways

    def _float_layers_call(self) -> DecodeLayersCall | None:
        """A float model's decode steps as one C++ call (one rank) or a call per layer part
        (tp > 1), where every rank of the group can run them so: CPU ranks, their own weights
        (not decode_dtype copies); the LM head reads the decode view's packed copy where it has
        one. Why not, where the model's layers do not fit the call, goes to rank_info. A
        collective where tp > 1: every rank asks at the same point."""
        plan = self.plan
        # (a triton attention backend asked for its own kernels, which the call would bypass)
        if (plan.weights is not None or plan.on_cuda or plan.decode_dtype is not None
                or plan.cp > 1 or plan.backend == "triton"):
            return None
        reason = self._on_every_rank(float_unfit_reason(self.model,
                                                        self.shard.heads.kv_head_of_q_head()))
        if reason is not None:
            self._layers_call_note = f"float-decode-layers: off ({reason})"
            return None
        return DecodeLayersCall(self.model, self.decode_model)

    def _on_every_rank(self, reason: str | None) -> str | None:
        """This rank's reason not to run the C++ layers, or another rank's reason: ranks that
        chose apart would sum differently made steps (a collective where tp > 1)."""
        if self.tp.world_size() == 1:
            return reason
        fit = self.tp.all_reduce(torch.tensor([float(reason is None)]))
        if reason is None and int(fit.item()) < self.tp.world_size():
            return "another rank of the group cannot run them"
        return reason

    def _choose_decode_call(self) -> None:
        """A CPU rank whose decode steps no graph timing offered the C++ layers (an eager
        engine, or one of tp > 1 ranks; a collective there: every rank runs it at the same
        point): a float model's decode step timed as one C++ call (one rank) or a call per
        layer part (tp > 1) and as the rank runs it otherwise (graphs or eager), alternated on
        every rank at once; rank 0's timings decide for all; one rank keeps its timing on disk
        (KernelChoice.choose_decode_call)."""
        if not self.plan.measure_kernels:
            return
        layers_call = self._float_layers_call()
        if layers_call is None:
            return
        start, plan = time.perf_counter(), self.plan
        context = min(GRAPH_TIMING_TOKENS, plan.max_model_len - 1)
        batch = warm_up_batch(1, context, 1, plan.block_size)
        graphs = self.compiled is not None and self.compiled.usable
        other = "graph" if graphs and self.compiled.graph_steps["decode"] else "eager"
        call = ONE_CALL if plan.world_size == 1 else PART_CALLS

        def run(way: str) -> None:
            self.layers_call = layers_call if way == call else None
            self.execute(batch)

        setup = self._step_setup(context) if plan.world_size == 1 else None
        way = self.kernels.choose_decode_call({way: partial(run, way) for way in (other, call)},
                                              call, self._model_shape(), self._first_rank_seconds,
                                              setup)
        self.layers_call = layers_call if way == call else None
        self.kernel_choice_s += time.perf_counter() - start

    def _first_rank_seconds(self, seconds: dict[str, float]) -> dict[str, float]:
        """Rank 0's timings, on every rank (x + 0 is x: each rank reads the same numbers)."""
        names = sorted(seconds)
        mine = [seconds[n] if self.tp.rank() == 0 else 0.0 for n in names]
        return dict(zip(names, self.tp.all_reduce(torch.tensor(mine, dtype=torch.float64))
                        .tolist()))

    def _model_shape(self) -> tuple[int, ...]:
        m = self.plan.model
        return (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim,
                m.intermediate_size, m.vocab_size)

    def execute(self, batch: Batch) -> StepResult | None:
        """One step: prepare its context, run the model, then logits, scores and samples.
        Rank 0 returns the result; the other ranks None."""
        timer = StepTimer(self.rank, self.tp.clock, self.device if self.plan.on_cuda else None)
        ctx = self.prepare(batch)
        model = self.decode_model if ctx.decode_weights else self.model
        score = None
        if ctx.graph == LAYERS_CALL:
            logits = self._gathered(self.layers_call.logits(ctx), batch)
        elif ctx.graph.startswith("decode"):
            logits = self._gathered(self.compiled.decode_logits(ctx), batch)
        else:
            # the layers graph runs under no_grad (CompiledModel.forward says why)
            with torch.no_grad() if ctx.graph else torch.inference_mode():
                x, residual = self.compiled.forward(ctx) if ctx.graph else model(ctx)
            logits = self._logits_model(model, batch).logits(x, residual, ctx.logits_indices)
            score = score_batch(self.model, x, residual, batch)  # None unless it scores rows
        if self.context is not None:  # the logits rows of every context rank, to rank 0
            logits = self.context.gather_logits(logits, ctx.meta)
        result = timer.result(score)
        if result is not None:
            result.graph = ctx.graph
            if logits is not None:  # None: every sequence is mid-prompt, nothing to sample
                sample_into(self.sampler, logits.cpu(), batch, result)
        return result

    def _logits_model(self, model: torch.nn.Module, batch: Batch) -> torch.nn.Module:
        """The view whose LM head computes a step's logits: a prompt step's few sampled rows
        also read a bf16 model's packed copy of the LM head where it has one (the plain bf16
        weight took 17 ms for one row of SmolLM2 on the AMX Xeon, the packed one 4.6 ms);
        decode_dtype copies never serve a prompt (they would change its float32 logits)."""
        if (self.decode_model is not None and self.plan.decode_dtype is None
                and len(batch.logits_indices) <= STREAMED_ROWS):
            return self.decode_model
        return model

    def prepare(self, batch: Batch) -> StepContext:
        """The step's context, built once: the one place that decides how a step runs
        (context-parallel, compiled decode graph, micro-batches, layers graph, or eager)."""
        mode = step_mode(batch)
        decode_weights = self.decode_model is not None and mode == DECODE
        if self.context is not None:
            ctx = self.context.prepare(batch, self.cache)
            ctx.decode_weights = decode_weights
            return ctx
        if mode == DECODE and self.layers_call is not None and self._tracer is None:
            ctx = pad_decode_step(batch, self.cache, self.kv_head_of_q_device, batch.num_seqs)
            ctx.graph = LAYERS_CALL
            return ctx
        compiled = self.compiled if self.compiled is not None and self.compiled.active else None
        rows = compiled.decode_bucket(batch.num_seqs) if compiled and mode == DECODE else None
        if rows is not None:
            return compiled.decode_context(batch, self.cache, self.kv_head_of_q_device, rows,
                                           decode_weights and self.plan.decode_dtype is not None)
        inputs = {"token_ids": batch.token_ids, "positions": batch.positions,
                  "logits_indices": batch.logits_indices}
        meta = build_step_metadata(batch.cu_seqlens_q, batch.context_lens, batch.block_tables,
                                   batch.slot_mapping, self.kv_head_of_q, self.device,
                                   uniform_groups=self.uniform_groups, inputs=inputs,
                                   block_size=self.cache.block_size)
        # beside decode graphs, steps read the model's own weights (compiled for them)
        decode_graphs = compiled is not None and compiled.graph_steps["decode"]
        ctx = StepContext(mode, meta.token_ids, meta.positions, meta.logits_indices,
                          self.cache, meta, self.backend.step_ops(meta.is_decode),
                          decode_weights=decode_weights and not decode_graphs)
        if self.plan.overlap_comm and self.plan.world_size > 1 and batch.num_tokens >= 2:
            return with_halves(ctx, batch, self.kv_head_of_q, self.uniform_groups)
        if not batch.score_indices and 2 * len(batch.logits_indices) <= batch.num_tokens:
            # the last layer's MLP for the sampled rows only: ~2.5 % of a SmolLM2 prompt's
            # products (the other rows' output is never read)
            ctx.last_layer_rows, ctx.logits_indices = ctx.logits_indices, torch.arange(
                len(batch.logits_indices), device=self.device)
        if compiled is not None and compiled.runs_layers(batch.num_tokens, mode == DECODE):
            ctx.graph = "layers"
        return ctx

    def _gathered(self, local: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        """A decode graph's logits rows that sample, gathered over the vocabulary to rank 0."""
        if not batch.logits_indices:  # every rank sees the same batch: all skip the gather
            return None
        # a decode step samples every sequence, i.e. the graph's first rows: no index copy
        if batch.logits_indices == list(range(len(batch.logits_indices))):
            local = local[:len(batch.logits_indices)]
        else:
            local = local[torch.tensor(batch.logits_indices, device=self.device)]
        logits = self.model.lm_head.gather(local)
        return None if logits is None else logits.float()

    def info(self) -> RankInfo:
        heads = self.shard.heads
        return RankInfo(self.rank, heads.q_heads, heads.kv_heads, self.shard.ffn, self.shard.vocab,
                        sum(p.numel() * p.element_size() for p in self.model.parameters())
                        + self.decode_bytes + self.prompt_copy_bytes + self.quantized_bytes,
                        self.plan.kv_bytes_per_token(heads.num_kv_heads), self.cache.num_blocks,
                        self.cache.nbytes, os.getpid(),
                        self.compiled is not None and self.compiled.usable, self.warmup_s,
                        self.load_s, self.digest.seconds,
                        self.kernels.describe() + [note for note in (self._layers_call_note,
                                                                     self._graphs_note) if note],
                        self.kernel_choice_s, self.huge_page_bytes, self.tp.all_reduce_kind())

    def weight_digest(self) -> Slices:
        """The digests of every weight slice this rank loaded (the driver combines them)."""
        return self.digest.slices

    def release_memory(self) -> None:
        """The rank is done: its KV cache's memory goes back at once (KVCache.release), on a
        GPU to the driver too: the next engine sizes its cache from the memory the driver
        reports free, which torch's cached blocks are not."""
        self.cache.release()
        if self.plan.on_cuda:
            torch.cuda.empty_cache()

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
        roots = [("", self.model), ("sampler", self.sampler)]
        if self.decode_model is not None:  # decode steps run the view with the decode weights
            roots.append(("", self.decode_model))
        self._tracer = OpTracer(self.rank, self.device, roots, self.tp.world_size())
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
            return self.context.read_kv(self.cache, layer, block_table, length)
        k, v = self.cache.gather(layer, block_table, length)
        return k.cpu(), v.cpu()


def indexed_device(device: str) -> torch.device:
    """`device` with an index on CUDA: torch.cuda.set_device refuses a bare "cuda", and a
    bare one elsewhere would mean "the current device", whatever another thread set."""
    dev = torch.device(device)
    return torch.device("cuda", dev.index or 0) if dev.type == "cuda" else dev
