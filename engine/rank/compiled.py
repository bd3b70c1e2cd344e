"""`compile=True`: a rank's forward as torch.compile'd graphs of one decoder layer each.

Every layer has the same ops on weights of the same shapes, so one layer's graph serves all
of them (regional compilation): the weights are the graph's inputs, and the layer's index (its
slice of the KV cache) a symbolic integer. A model compiles a few one-layer graphs, not
whole-model graphs of every layer: SmolLM2's 30 layers took ~250 s to compile cold on the AMX
Xeon as whole-model graphs (BENCHMARKS.md).

- A decode step (one new token per sequence, at most `DECODE_BUCKETS[-1]` sequences, nothing
  scored) runs its layers' graph with static shapes, then the final norm and this rank's slice
  of the LM head, as a graph of their own for 1-2 rows and eagerly for more: its rows are
  padded to the next size bucket, and each bucket is compiled once. Its float32 and bf16
  projections of 1-2 rows become streaming multiply-and-sum loops (engine.rank.gemm), its
  paged attention is tensor math over the block table (padded_decode) and its small ops fuse,
  so a layer is its weight reads plus little else.
- Any other step of more than EAGER_ROWS tokens runs the layer graph with a dynamic token
  count; shorter ones (rare) run eagerly. The embedding runs eagerly: one row gather.
- A one-rank engine times each kind (prompt, decode; a GPU's prompts only, its decode steps
  replaying CUDA graphs) through its graphs and eagerly after the warm-up, and runs a kind
  eagerly where that is faster (`graph_steps`, set by the Worker).
- A CPU rank keeps each graph on disk whole (engine.rank.kept_graphs), so a later start loads
  it instead of tracing it (SmolLM2 bf16: 12 s to start, not 18-22 s, on the AMX Xeon).

Nothing breaks a graph: the KV store (and, in the prompt graph, attention with it) and the
all-reduce are registered custom ops (graph_ops, parallel.comm). Compilation (and Triton's,
for the triton backend) happens in a warm-up when the rank starts, never inside a request's
step timeout; a failed compile falls back to eager with one warning. Tracing (the
walkthrough) runs eagerly.
"""
from __future__ import annotations

import bisect
import dataclasses
import hashlib
import itertools
import platform
import types
from typing import Callable

import torch
from torch import nn

from engine.batch import Batch
from engine.machine import cache_dir, read_whole, write_whole
from engine.rank.cuda_graphs import DecodeGraphs, widths_up_to
from engine.rank.graph_ops import LAYERS_GRAPH_OPS, running
from engine.rank.kept_graphs import KeptGraph, graph_file
from engine.rank.kernel_choice import keep_compiled_code, machine_key
from engine.rank.kv_cache import KVCache
from engine.rank.model import last_layer
from engine.rank.padded_decode import pad_decode_step
from engine.rank.step_context import StepContext
from engine.rank.gemm import EAGER_ROWS, MATVEC_ROWS

DECODE_BUCKETS = (1, 2, 4, 8)
# dynamo's name for a layer's index (KVStore's and PagedAttention's layer_idx), as a pattern
LAYER_INDEX_SOURCE = r".*\.layer_idx$"
_UNKEPT_MODELS = itertools.count()  # names the graphs of models not kept on disk (a GPU's)


def trust_probed_vector_isas() -> None:
    """Inductor checks each vector ISA the CPU's flags claim (AVX2, AVX-512, AMX...) by building
    a probe and loading it in a child process, once per process: 2.7 s of every compiled start
    on the AMX Xeon. Once every claimed ISA has passed on this machine (kept on disk per CPU,
    torch and C++ compiler), later starts tell inductor so instead of probing again. Where a
    claimed ISA failed nothing is recorded or set: inductor probes, and skips that one."""
    from torch._inductor import config as inductor_config, cpu_vec_isa
    from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler

    if platform.machine() not in ("x86_64", "AMD64") or inductor_config.cpp.vec_isa_ok is not None:
        return  # another architecture, or the user (TORCHINDUCTOR_VEC_ISA_OK) decided
    flags = cpu_vec_isa.x86_isa_checker()
    claimed = [str(isa) for isa in cpu_vec_isa.supported_vec_isa_list
               if all(flag in flags for flag in str(isa).split())]
    if not claimed:
        return  # nothing to probe
    compiler = get_cpp_compiler()
    version = hashlib.sha256(get_compiler_version_info(compiler).encode()).hexdigest()[:16]
    key = f"{machine_key()}|{compiler} {version}"
    path = cache_dir() / "vector_isas.json"
    kept = read_whole(path)
    if kept.get(key) != claimed:
        if [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()] != claimed:  # the probes
            return
        write_whole(path, {**kept, key: claimed})
    # set on the probing start too: the setting is part of inductor's cache keys, so every
    # start then finds the code the first one compiled
    inductor_config.cpp.vec_isa_ok = True


class CompiledModel:
    """A rank's two kinds of graph, and which steps take which."""

    def __init__(self, model: nn.Module, decode_model: nn.Module | None = None,
                 keep_key: str | None = None, fused_decode: bool = False):
        """`decode_model`: the view whose projections read decode_dtype copies (decode_weights),
        which the decode graph runs when a step asks for it. `keep_key`: what the graphs depend
        on besides their code and tensor inputs (engine.rank.kept_graphs), to keep them on disk
        under (it must name `fused_decode`); None: compiled by every start (a GPU rank).
        `fused_decode`: decode graphs store and attend through the fused CPU kernel
        (engine.rank.padded_decode)."""
        self.model, self.decode_model = model, decode_model or model
        self.fused_decode = fused_decode
        keep_compiled_code()
        if all(p.device.type == "cpu" for p in model.parameters()):  # CPU code uses the ISAs
            trust_probed_vector_isas()
        self.usable = True  # False once compiling failed here: eager from then on
        self.enabled = True  # off while the tracer watches the eager modules
        # (rows, decode_weights) of the decode graphs that have run once with every guard
        # checked, i.e. compiled for every layer (_run_decode)
        self._decode_ran: set[tuple[int, bool]] = set()
        # the step kinds that run their graphs: a one-rank engine times them against eager
        # after the warm-up and keeps the faster (Worker._choose_graph_steps)
        self.graph_steps = {"prompt": True, "decode": True}

        # dynamo learns which sizes and floats vary per code name (its automatic-dynamic
        # state): names of this setup's own, so another model in this process (its sizes, its
        # floats such as the attention scale) makes none of them symbolic here; a symbolic
        # float failed the next engine's compile (TensorifyScalarRestartAnalysis)
        setup = (hashlib.sha256(keep_key.encode()).hexdigest()[:12] if keep_key is not None
                 else f"unkept{next(_UNKEPT_MODELS)}")

        def graph(fn: Callable, name: str, rows: int | None = None, **options) -> KeptGraph:
            # torch.compile keeps graphs (and a limit of 8 recompiles) per code object: each
            # graph gets a code object of its own, so engines of other shapes in this process
            # never push this one's graphs out to eager; and each bucket's a name of its own:
            # the buckets' row counts must not look like one dynamic size (nor dynamic=False,
            # which would specialise the layer index too)
            path = (graph_file(cache_dir() / "graphs", name, keep_key)
                    if keep_key is not None else None)
            return KeptGraph(own_code(fn, setup, rows), path, **options)

        self._layer = graph(_layer, "layer", mark=_mark_rows)  # token count dynamic

        def decode_graphs(view: str) -> tuple[dict[int, KeptGraph], dict[int, KeptGraph]]:
            # the head's graph only where its product streams (engine.rank.gemm): wider
            # buckets' graphs called oneDNN as eager does, and each graph cost ~1 s of a start
            return ({rows: graph(_layer, f"decode{rows}{view}", rows, mark=_mark_table)
                     for rows in DECODE_BUCKETS},
                    {rows: graph(_decode_head, f"head{rows}{view}", rows, dynamic=False)
                     for rows in DECODE_BUCKETS if rows <= MATVEC_ROWS})

        self._decode_layer, self._decode_head = decode_graphs("")
        # the decode view's weights are other inputs: graphs of their own (kept apart)
        self._view_decode_layer, self._view_decode_head = (
            decode_graphs("-view") if self.decode_model is not model
            else (self._decode_layer, self._decode_head))
        self.cuda_graphs: DecodeGraphs | None = None  # on CUDA, once captured

    def capture_decode_graphs(self, cache: KVCache, kv_head_of_q: torch.Tensor,
                              max_model_len: int, decode_weights: bool) -> None:
        """On CUDA, after the warm-up compiled the decode graphs: capture each bucket at each
        table width, so decode steps replay instead of launching kernel by kernel."""
        self.cuda_graphs = DecodeGraphs(self._run_decode, cache, kv_head_of_q, decode_weights)
        self.cuda_graphs.capture(DECODE_BUCKETS, widths_up_to(max_model_len, cache.block_size))

    @property
    def active(self) -> bool:
        return self.usable and self.enabled

    def runs_layers(self, num_tokens: int, decode: bool) -> bool:
        """Whether a step of `num_tokens` (not a decode graph's) runs the layers graph: a
        prompt (or mixed) step where prompts keep their graphs, a decode step too wide for the
        decode graphs where decode steps keep theirs. Steps of at most EAGER_ROWS tokens run
        eagerly: with them in its range, the graph's token count could not tell its
        projections which product to take without a guard, and such steps (a prompt's last 2
        tokens, say) are rare and short."""
        kind = "decode" if decode else "prompt"
        return self.active and self.graph_steps[kind] and num_tokens > EAGER_ROWS

    def decode_bucket(self, num_seqs: int) -> int | None:
        """The padded row count of a decode step of `num_seqs` sequences (None: too many, or
        the graphs are off)."""
        at = bisect.bisect_left(DECODE_BUCKETS, num_seqs)
        usable = self.active and self.graph_steps["decode"] and at < len(DECODE_BUCKETS)
        return DECODE_BUCKETS[at] if usable else None

    def forward(self, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers through the prompt graph: (hidden, residual) of every row. The graph gets
        the context with the one opaque op as its `ops`; the op reads the step's own context
        (`running`). Run under no_grad, not in inference mode: a graph traced in inference mode
        cannot write the KV cache (its input), and entering inference mode inside the graph
        keeps AOTAutograd from caching it (~4 s of every compiled start-up on the AMX Xeon)."""
        graph_ctx = dataclasses.replace(ctx, meta=None, ops=LAYERS_GRAPH_OPS)
        with running(ctx):
            return _run_layers(self._layer, self.model, graph_ctx)

    def decode_context(self, batch: Batch, cache: KVCache, kv_head_of_q: torch.Tensor,
                       rows: int, decode_weights: bool) -> StepContext:
        """A decode step's context for the graph of `rows` rows: a captured CUDA graph's own,
        refilled, where one fits it."""
        if self.cuda_graphs is not None:
            ctx = self.cuda_graphs.load(batch, rows)
            if ctx is not None:
                return ctx
        return pad_decode_step(batch, cache, kv_head_of_q, rows, decode_weights,
                               self.fused_decode)

    def decode_logits(self, ctx: StepContext) -> torch.Tensor:
        """This rank's logits slice of every row of a decode context: replayed where it is a
        captured graph's."""
        replayed = self.cuda_graphs.replay(ctx) if self.cuda_graphs is not None else None
        return replayed if replayed is not None else self._run_decode(ctx)

    def _run_decode(self, ctx: StepContext) -> torch.Tensor:
        """After its first run, a decode graph's layer calls skip their guards: a bucket's one
        layer graph (its layer index symbolic) has static shapes and a fixed weight view, and
        that first run, through every layer, checked them all. The full guards (hundreds:
        every weight, every context field) cost ~0.16 ms a layer, 12 % of a SmolLM2 decode
        step on the AMX Xeon."""
        model = self.decode_model if ctx.decode_weights else self.model
        rows = len(ctx.token_ids)
        layers, heads = ((self._view_decode_layer, self._view_decode_head) if ctx.decode_weights
                         else (self._decode_layer, self._decode_head))
        graphs = (rows, ctx.decode_weights)
        with torch.no_grad():
            with torch.compiler.set_stance(skip_guard_eval_unsafe=graphs in self._decode_ran):
                x, residual = _run_layers(layers[rows], model, ctx)
            if graphs not in self._decode_ran:
                self._decode_ran.add(graphs)
                if isinstance(layers[rows], KeptGraph):
                    layers[rows].trust()
            return heads.get(rows, _decode_head)(model, x, residual)


def own_code(fn: Callable, setup: str, rows: int | None = None) -> Callable:
    """`fn` with code of its own, named after it and `setup` (and `rows`): dynamo keeps its
    graphs, at most 8, per code object, so graphs that must not evict each other get their own."""
    name = f"{fn.__name__}_{setup}" + ("" if rows is None else f"_rows{rows}")
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name)


def _run_layers(layer_graph: Callable, model: nn.Module,
                ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Embed eagerly, then every layer through `layer_graph` (the last one eagerly where the
    step runs its MLP over ctx.last_layer_rows only). The first layer gets a zero residual
    rather than None (x + 0 is x), so it takes the same graph as the others."""
    x = model.embed_tokens(ctx.token_ids)
    residual = torch.zeros_like(x)
    # a layer's index is an int attribute of its modules: symbolic from the first call, so
    # layer 0 takes the graph every other layer takes (left to dynamo, it would specialise
    # layer 0's graph and learn the index varies only at layer 1: a graph more per kind, ~1 s
    # of every compiled start-up even with inductor's code cached)
    with torch.compiler.config.patch(dynamic_sources=LAYER_INDEX_SOURCE):
        for layer in model.layers[:-1]:
            x, residual = layer_graph(layer, x, residual, ctx)
        if ctx.last_layer_rows is None:
            return layer_graph(model.layers[-1], x, residual, ctx)
    # its MLP over a few rows: eagerly (a graph of its own would cost start-up time)
    return last_layer(model.layers[-1], x, residual, ctx)


def _mark_rows(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor,
               ctx: StepContext) -> None:
    """The layers graph's token count is dynamic, above EAGER_ROWS (its projections stay
    oneDNN's, or a quantized weight's dequantized product)."""
    for rows in (x, residual, ctx.positions):
        torch._dynamo.mark_dynamic(rows, 0, min=EAGER_ROWS + 1, max=2**24)


def _mark_table(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor,
                ctx: StepContext) -> None:
    """A decode graph's block table width is dynamic: one graph for every context length."""
    torch._dynamo.mark_dynamic(ctx.meta.block_table, 1)


def _layer(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor,
           ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
    return layer(x, residual, ctx)


def _decode_head(model: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """Every row's logits for this rank's vocabulary slice, before the gather: each row is a
    sequence's newest token, and every row samples."""
    x, _ = model.norm(x, residual)
    return model.lm_head.local(x)
