"""Which CPU kernel runs each projection and each prompt's attention, decided by timing the
candidates on this machine, at the shapes this rank runs, and keeping the fastest.

Why measure instead of a rule: a choice measured faster on one of our CPUs was slower on another
(oneDNN's inner product beat MKL by 2x on an AMD EPYC, where MKL takes a slow path, and lost at
some shapes on an Intel Xeon with AMX; blocked bf16 attention beat SDPA by 2.5x on the EPYC).
The built-in choice is always among the candidates, so a CPU where it is fastest keeps it.

A projection's time depends on its weight's shape and the number of rows: rows are bucketed by
powers of 4 (1, 2-4, 5-16, ..., 1025-4096, more) and each bucket is timed at its largest row count
(capped at the step's token budget). A prompt's attention is bucketed the same way by its
length, and a decode step's one query by its context length.
Timings are kept on disk per CPU model, torch version, thread count and shape
(`$PREFILL_ENGINE_CACHE`, else ~/.cache/prefill-engine), so only the first start-up on a machine
pays for them (and one a week: engine.machine.REMEASURE_AFTER); with compile=True so are whole
steps timed through their graphs against eager (under the model's shape and the settings they
depend on), and the decode graph's attention.
Quantized weights (weights=...) time their shapes' few-row products (engine.rank.quantized_rows).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_runtime
from engine.machine import (cache_dir, cpu_description, measured_long_ago, read_whole,
                            write_whole)
from engine.rank import fused_attention, gemm, ops, quantized_rows
from engine.rank.attention import (fixed_prompt_kernel, float32_decode_attention,
                                   sdpa_attention, torch_attention)
from engine.rank.backend import Backend
from engine.rank.blocked_attention import blocked_causal_attention
from engine.rank.host_memory import available_bytes
from engine.rank.kv_cache import KVCache
from engine.rank.padded_decode import PaddedDecode, padded_context
from engine.rank.quantized import KERNEL_ROWS, QuantizedWeight
from engine.rank.step_context import StepContext
from parallel.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

log = logging.getLogger("engine")

# buckets of at most this many rows are timed streaming STREAMED_BYTES of weight copies
STREAMED_ROWS = 16
STREAMED_BYTES = 64 * 2**20
MAX_COPIES = 64  # a tiny weight stays in cache however many copies: no point in more
# A compiled timing's copies are products unrolled in one static graph, whose compile grows
# with them: a test model's tiny shapes at 64 copies took 30-38 s a timing. Real models need
# fewer to pass STREAMED_BYTES: SmolLM2's shapes with its LM head need one (tp=2's halves two).
MAX_GRAPH_COPIES = 8
LM_HEAD_ROWS = 64  # above this many logits rows (scoring a prompt) the LM head is untimed
# the most rows timed: larger steps take the pick of the largest bucket timed (a projection's
# kernel ranks alike from ~1k rows on, and timing 8k-token attention would take seconds)
MAX_TIMED_ROWS = 2048
# the longest context a decode step's attention is timed at; longer ones take its pick
MAX_TIMED_CONTEXT = 8192
# The context the decode graph's attention is timed at: one choice serves every length. The
# timing's caches stay warm, a step's do not (its weights stream through between layers), which
# understates what the fused kernel saves the more, the shorter the context: on the AVX512 EPYC
# it timed 1.2x the tensor math at 256 keys, 1.1-1.4x at 1024 and 1.4-2.0x at 4096 (2 threads,
# `python -m bench.cpu_ops`, BENCHMARKS.md session 42).
GRAPH_DECODE_CONTEXT = 2048
TIMED_DECODE_LAYERS = 8  # layers in one timed graph: its call's own cost shared, as in a step
# another kernel replaces the built-in one only when at least this much faster: timings on a
# shared machine jitter by more than the gaps between close candidates
MARGIN = 1.10
# Prompts read copies of the projections packed by oneDNN (engine.rank.gemm.PromptCopies) for
# the shapes whose product at PROMPT_COPY_ROWS rows timed this much faster packed: a
# warm weight gained 3-5 % on the AVX512-BF16 EPYC (the start-up timing's case; a step's cold
# weights gain more), below MARGIN, and a wrong pick costs a copy's memory and a step a few %
# slower, no wrong answer
PROMPT_COPY_ROWS = 512
PROMPT_COPY_MARGIN = 1.02
# A prompt step runs through its graph only where timed this much faster than eagerly: at
# parity eager is the pick, since a start whose timings kept say no kind runs through graphs
# builds none (Worker._compiled_model; SmolLM2 float32 prompts on the Zen 5 EPYC: 137 ms eager
# against 139 through the graph). A prompt step takes hundreds of ms, timed whole both ways in
# one process: steadier than the short kernels MARGIN guards. Its graph calls the kernels an
# eager step calls, one per weight shape, where an eager step takes each row count's pick (on
# the AMX Xeon, MKL's product for SmolLM2's 3072-row weight at 2048 float32 rows): eager
# prompts there timed faster, by less than MARGIN (BENCHMARKS.md, session 56).
GRAPH_PROMPT_MARGIN = 1.02
# the copies are not offered where they would take more than this share of the memory the
# machine has available at start-up (a large model's would leave too little for the rest)
PROMPT_COPY_MEMORY = 0.5
# A prompt's gate/up product applies the SiLU·mul inside oneDNN (engine.rank.gemm.gated_halves)
# where timed faster than the packed product and a SiLU·mul pass, by any margin: both hold the
# same copies' bytes and give the same answer to rounding, so a wrong pick costs a few % at
# most (they tie at 512 rows on the AVX512-BF16 EPYC, BENCHMARKS.md session 47)
GATED_MARGIN = 1.0


def linear_kernels(dtype: torch.dtype, rows: int) -> dict[str, Callable]:
    """(x, weight, bias) -> x Wᵀ + b for `rows` rows. "torch": F.linear, torch's own CPU GEMM
    (MKL for float32 on x86); "onednn": oneDNN's inner product, the built-in choice where it
    runs this dtype (engine.rank.gemm); for bf16, "float32": the product of float32 copies of x
    and the weight, rounded back (on an AVX2-only CPU 8x torch's bf16 GEMM for 512 rows), and
    where oneDNN runs float32 products but not bf16 ones (an AVX2-only CPU), "float32-onednn":
    the same through oneDNN's float32 inner product (1.04-1.26x torch's per SmolLM2 shape on the
    Zen 5 EPYC held to AVX2, BENCHMARKS.md session 61); for one row, "mv": torch's
    matrix-vector product (matrix_vector_linear)."""
    kernels = {"torch": F.linear}
    if gemm.onednn_runs(dtype):
        kernels["onednn"] = gemm.eager_onednn_linear
    if dtype == torch.bfloat16:
        kernels["float32"] = float32_linear
        if gemm.onednn_runs(torch.float32) and not gemm.onednn_runs(dtype):
            kernels["float32-onednn"] = float32_onednn_linear
    if rows == 1:
        kernels["mv"] = matrix_vector_linear
    return kernels


def built_in_linear(dtype: torch.dtype) -> str:
    """The kernel engine.rank.gemm runs for this dtype when nothing was measured."""
    return "onednn" if gemm.onednn_runs(dtype) else "torch"


def _in_float32(product: Callable) -> Callable:
    """A low-precision product computed in float32 by `product`: the weight is widened per call
    (for a prompt's rows the widening is small beside the product), so no float32 copy is held."""
    def linear(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        wide_bias = None if bias is None else bias.float()
        return product(x.float(), weight.float(), wide_bias).to(x.dtype)
    return linear


float32_linear = _in_float32(F.linear)
float32_onednn_linear = _in_float32(
    lambda x, weight, bias: torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], ""))


def matrix_vector_linear(x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """One row's product as torch.mv, whose bf16 kernel widens the weight as it streams it
    (SmolLM2's gate/up at start-up on a Xeon with AMX: 0.38 ms against oneDNN's one-row inner
    product's 0.49); more rows: F.linear."""
    if x.shape[0] != 1:
        return F.linear(x, weight, bias)
    y = torch.mv(weight, x[0]) if bias is None else torch.addmv(bias, weight, x[0])
    return y.unsqueeze(0)


# A bfloat16 model's decode steps may read packed copies of its projection weights (a second
# copy, held beside the plain one that prompts read: packed weights were 20 % slower for 2048-row
# prompts and 25 % faster for one row on a Xeon with AMX). Considered for bfloat16 only: a
# float32 model that wants faster decode has decode_dtype="bfloat16", half the extra memory.
DECODE_COPY_DTYPES = (torch.bfloat16,)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return sdpa_attention(q, k, v, scale, shared_kv=k.shape[1] != q.shape[1])


def attention_kernels(dtype: torch.dtype) -> dict[str, Callable]:
    """(q [Tq, hq, d], k/v [Tk, hkv, d], scale) -> [Tq, hq, d]: a prompt's causal attention.
    "sdpa" (the built-in for float32), "blocked" (bf16's where oneDNN multiplies bf16) and,
    where it builds, "fused" (engine.rank.fused_attention: for SmolLM2's heads on the AVX512
    EPYC, 1.7x SDPA at 512 float32 tokens and 1.5x at 2048, 1.9x and 1.5x the blocked attention
    in bf16: `.venv/bin/python -m bench.cpu_ops --repeats 5`, BENCHMARKS.md session 41)."""
    kernels = {"sdpa": _sdpa, "blocked": blocked_causal_attention}
    if dtype in fused_attention.DTYPES and fused_attention.available():
        kernels["fused"] = fused_attention.causal_attention
    return kernels


def decode_attention_kernels(dtype: torch.dtype) -> dict[str, Callable]:
    """(q [1, hq, d], k/v [kv_len, hkv, d], scale) -> [1, hq, d]: a decode step's attention.
    "sdpa", the built-in, and "float32": the same attention as batched float32 products
    (engine.rank.attention.float32_decode_attention; a low-precision model's K/V widened). For
    a float32 model on the AMX Xeon the products timed 1.2x SDPA at 256 keys and 1.8x at
    4096: torch's CPU flash kernel splits one query's work into few, costly pieces."""
    return {"sdpa": _sdpa, "float32": float32_decode_attention}


def projection_weights(model: nn.Module) -> list[torch.Tensor]:
    """The float weight of every projection the model runs through its backend's `linear`
    (quantized ones, weights="int8"|..., have kernels of their own: engine.rank.quantized)."""
    return [m.weight for m in model.modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead))
            and isinstance(m.weight, torch.Tensor)]


def one_per_shape(weights: list[torch.Tensor]) -> dict[tuple[int, ...], torch.Tensor]:
    """One weight of each shape: the timings depend on the shape only."""
    return {tuple(w.shape): w for w in weights}


def row_bucket(rows: int) -> int:
    """b such that 4**(b-1) < rows <= 4**b (rows >= 1)."""
    return ((rows - 1).bit_length() + 1) // 2


def fastest(candidates: dict[str, Callable[[], object]], min_rounds: int = 5,
            min_seconds: float = 0.01, max_rounds: int = 50) -> dict[str, float]:
    """The best time of each candidate over alternating rounds, after one untimed call each
    (oneDNN builds its primitive on the first call): at least `min_rounds`, and more (up to
    `max_rounds`) until each has run `min_seconds` in all, so a tiny op's best is not one
    scheduler hiccup away from another's."""
    for fn in candidates.values():
        fn()
    best = {name: float("inf") for name in candidates}
    spent = dict.fromkeys(candidates, 0.0)
    for round_ in range(max_rounds):
        if round_ >= min_rounds and min(spent.values()) >= min_seconds:
            break
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            took = time.perf_counter() - start
            best[name], spent[name] = min(best[name], took), spent[name] + took
    return best


@dataclass(slots=True)
class Pick:
    """One decision: the op, the shape it covers, each candidate's time, and the winner."""

    op: str  # "linear", "attention", "decode-attention", "decode-weights", "graph-...", ...
    shape: tuple[int, ...]  # a weight's (out, in), or attention's (heads, kv heads, head dim)
    rows: int  # the row count (tokens; keys for a decode attention) timed: the top of its bucket
    built_in: str  # the kernel run without measuring
    seconds: dict[str, float] = field(default_factory=dict)
    from_disk: bool = False
    margin: float = MARGIN
    how: dict[str, str] = field(default_factory=dict)  # how a kernel runs here, where it varies

    @property
    def kernel(self) -> str:
        """The fastest, unless the built-in kernel is within `margin` of it."""
        best = min(self.seconds, key=self.seconds.get)
        kept = self.seconds.get(self.built_in, float("inf"))
        return self.built_in if kept <= self.seconds[best] * self.margin else best

    def describe(self) -> str:
        times = ", ".join(f"{k} {s * 1e3:.3g} ms" for k, s in sorted(self.seconds.items()))
        what = " ".join(filter(None, (self.op, "x".join(map(str, self.shape)))))
        unit = "keys" if self.op in ("decode-attention", "graph-decode-attention") else "rows"
        how = f" [{self.how[self.kernel]}]" if self.kernel in self.how else ""
        return (f"{what} at {self.rows} {unit}: "
                f"{self.kernel}{how} ({times}{', kept on disk' if self.from_disk else ''})")


@dataclass(slots=True)
class KernelChoice:
    """The kernels a CPU rank runs, per shape and row bucket. Empty (before `measure`, or when
    measuring is off) it runs the built-in choices. It is the backend's `linear` and its prompt
    attention's chooser, so a choice costs a dictionary lookup per call."""

    dtype: torch.dtype
    picks: list[Pick] = field(default_factory=list)
    _linear: dict[tuple[int, int, int], Callable] = field(default_factory=dict)
    _linear_names: dict[tuple[int, int, int], str] = field(default_factory=dict)  # its picks
    _attention: dict[tuple[torch.dtype, int], Callable] = field(default_factory=dict)
    _top_bucket: int = 0  # the largest bucket timed; more rows take its picks
    _decode_attention: dict[tuple[torch.dtype, int], Callable] = field(default_factory=dict)
    _top_context_bucket: int = 0  # the same for a decode step's context length
    # weight shapes whose decode steps read a packed copy (DECODE_COPY_DTYPES); empty: none
    packed_decode_shapes: set[tuple[int, int]] = field(default_factory=set)
    # weight shapes whose prompt steps read a copy packed for prompt_copy_rows rows (the rank
    # makes them: engine.rank.gemm.PromptCopies); empty: none
    packed_prompt_shapes: set[tuple[int, int]] = field(default_factory=set)
    prompt_copy_rows: int = PROMPT_COPY_ROWS
    # the gate/up weight shape whose prompt products apply the SiLU·mul in oneDNN, from packed
    # copies of the weight's halves (gated_linear); None: product, then SiLU·mul
    gated_prompt_shape: tuple[int, int] | None = None
    # compile=True: a graph's products of at most gemm.MATVEC_ROWS fixed rows call torch's
    # matmul instead of the multiply-and-sum, when timed faster in a graph
    graph_rows_call_torch: bool = False
    # compile=True: the decode graph stores and attends through the fused CPU kernel, when
    # timed faster than its own tensor math (engine.rank.padded_decode)
    graph_decode_fused: bool = False
    # (kind, shape) of quantized weights (weights=...) whose products of at most KERNEL_ROWS
    # rows run the C++ kernels (engine.rank.quantized_rows) instead of torch's, where timed faster
    quantized_rows_shapes: set[tuple[str, tuple[int, int]]] = field(default_factory=set)
    # each timed (kind, shape)'s seconds per kernel ("torch", "fused"): a quantized decode
    # step's layers in one call weigh a layer's products together (engine.rank.quantized_layers)
    quantized_rows_seconds: dict[tuple[str, tuple[int, int]], dict[str, float]] = field(
        default_factory=dict)

    def linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            if ((weight.kind, weight.shape) in self.quantized_rows_shapes
                    and x.numel() // x.shape[-1] <= KERNEL_ROWS):
                return quantized_rows.linear(x, weight, bias)
            return gemm.linear(x, weight, bias)
        if (self.graph_rows_call_torch and torch.compiler.is_compiling()
                and isinstance(weight, torch.Tensor) and weight.dtype == x.dtype
                and gemm.few_fixed_rows(x)):
            return F.linear(x, weight, bias)
        if (isinstance(weight, torch.Tensor) and x.dim() == 2 and x.dtype == weight.dtype
                and not torch.compiler.is_compiling() and not weight.is_mkldnn
                and weight.is_contiguous()):
            bucket = min(row_bucket(x.shape[0]), self._top_bucket)
            kernel = self._linear.get((weight.shape[0], weight.shape[1], bucket))
            if kernel is not None:
                return kernel(x, weight, bias)
        return gemm.linear(x, weight, bias)  # graphs, packed or mixed-dtype weights, unmeasured

    def gated_linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
                     bias: torch.Tensor | None = None,
                     silu_mul: Callable = ops.silu_mul) -> torch.Tensor:
        """The MLP's SiLU(x W_gateᵀ) · (x W_upᵀ) (Backend.gated_linear): through oneDNN's
        fused halves for a gate/up shape picked so (its graph op finds the halves at run
        time, and runs decode-sized rows as below), else `linear`, then `silu_mul` (the
        backend's)."""
        if (bias is None and isinstance(weight, torch.Tensor) and x.dim() == 2
                and tuple(weight.shape) == self.gated_prompt_shape and x.dtype == weight.dtype
                and not weight.is_mkldnn and not gemm.few_fixed_rows(x)):
            if torch.compiler.is_compiling():
                return gemm.gated_product(x, weight)
            if x.shape[0] > gemm.PLAIN_WEIGHT_ROWS:
                return gemm.eager_gated_product(x, weight)
        return silu_mul(self.linear(x, weight, bias))

    def prompt_kernel(self, q_len: int, dtype: torch.dtype) -> Callable | None:
        """The attention of a prompt (or prompt chunk) of q_len > 1 tokens: the picked kernel
        (blocked, fused), or None for SDPA (engine.rank.attention). A chunk after a cached
        prefix takes the choice timed for a whole prompt of its length."""
        kernel = self._attention.get((dtype, min(row_bucket(q_len), self._top_bucket)))
        if kernel is None:
            return fixed_prompt_kernel(q_len, dtype)
        return None if kernel is _sdpa else kernel

    def decode_kernel(self, kv_len: int, dtype: torch.dtype) -> Callable | None:
        """The attention of one query over kv_len keys: None for SDPA, the built-in."""
        kernel = self._decode_attention.get(
            (dtype, min(row_bucket(kv_len), self._top_context_bucket)))
        return None if kernel is _sdpa else kernel

    def measure(self, weights: list[torch.Tensor], heads: tuple[int, int, int],
                max_tokens: int, lm_head_shape: tuple[int, ...] | None = None,
                max_context: int = 0, gate_up_shape: tuple[int, ...] | None = None) -> None:
        """Time every candidate at every (weight shape, row bucket) and (attention, length
        bucket) up to `max_tokens` rows; the LM head's only up to LM_HEAD_ROWS, its rows being
        the sequences that sample (larger ones: the largest timed); a decode step's attention
        at every context bucket up to `max_context` keys; the MLP's gate/up product of a
        prompt (`gate_up_shape`) with its SiLU·mul fused and not. Timings of the same machine
        and shape come from disk."""
        store = TimingStore.open()
        max_tokens = min(max_tokens, MAX_TIMED_ROWS)
        self._top_bucket = row_bucket(max_tokens)
        for shape, weight in one_per_shape(weights).items():
            top = min(LM_HEAD_ROWS, max_tokens) if shape == lm_head_shape else max_tokens
            for bucket in range(row_bucket(top) + 1):
                rows = min(4 ** bucket, top)
                linears = linear_kernels(self.dtype, rows)
                pick = store.get_or_time(Pick("linear", shape, rows, built_in_linear(self.dtype)),
                                         self.dtype, linears,
                                         lambda: _time_linear(linears, weight, rows))
                self.picks.append(pick)
                self._linear[(*shape, bucket)] = linears[pick.kernel]
                self._linear_names[(*shape, bucket)] = pick.kernel
        kernels = attention_kernels(self.dtype)
        # the fused kernel's timings hold for its source only: a changed kernel times again
        source = f"fused {fused_attention.source_hash()}" if "fused" in kernels else ""
        # its bf16 products: AMX tiles, AVX512-BF16 pairs or widened copies, by CPU
        how = ({"fused": f"bf16 products in {fused_attention.bf16_products(heads[2])}"}
               if "fused" in kernels and self.dtype == torch.bfloat16 else {})
        for bucket in range(1, row_bucket(max_tokens) + 1):  # one-token prompts run as decode
            rows = min(4 ** bucket, max_tokens)
            built_in = "sdpa" if fixed_prompt_kernel(rows, self.dtype) is None else "blocked"
            pick = store.get_or_time(Pick("attention", heads, rows, built_in, how=how),
                                     self.dtype, kernels,
                                     lambda: _time_attention(heads, rows, self.dtype, kernels),
                                     source)
            self.picks.append(pick)
            self._attention[(self.dtype, bucket)] = kernels[pick.kernel]
        self._choose_decode_attention(store, heads, max_context)
        self._choose_decode_copies(store, weights)
        self._choose_prompt_copies(store, weights, max_tokens, lm_head_shape)
        self._choose_gated_prompts(store, weights, gate_up_shape)
        store.save()

    def choose_graph_rows(self, weights: list[torch.Tensor]) -> None:
        """compile=True, float32 or bfloat16 on a CPU: time one compiled graph of one-row
        products over streamed copies of every projection shape, written as the multiply-and-
        sum (the built-in choice, 2.4x oneDNN on an AVX512 EPYC) and as torch's matmul (MKL,
        8 % faster on an AMX Xeon for SmolLM2's float32 shapes); graphs compiled afterwards take
        the pick. Nothing to time where every projection is quantized (weights=...)."""
        shapes = one_per_shape(weights)
        if self.dtype not in (torch.float32, torch.bfloat16) or not shapes:
            return
        candidates = {"multiply-and-sum": gemm.matvec, "torch": F.linear}
        pick = self._compiled_pick(
            Pick("graph-linear", tuple(sorted(shapes)), 1, "multiply-and-sum"), candidates,
            lambda: _time_in_graph(candidates, list(shapes.values())), "",
            "compiled products", "the multiply-and-sum")
        self.graph_rows_call_torch = pick is not None and pick.kernel == "torch"

    def _compiled_pick(self, pick: Pick, candidates: dict, measure: Callable[[], dict],
                       setup: str, what: str, kept: str) -> Pick | None:
        """`pick` timed by compiling graphs (or read from disk), and kept; None, with one
        warning naming `what` was timed and which built-in is `kept`, where compiling failed
        (as a failed compile at start-up keeps eager: engine.rank.warmup)."""
        store = TimingStore.open()
        try:
            pick = store.get_or_time(pick, self.dtype, candidates, measure, setup)
        except Exception as e:  # noqa: BLE001  whatever inductor or the compiler raised
            log.warning("timing %s failed on this setup (%s: %s); %s stays", what,
                        type(e).__name__, e, kept)
            return None
        store.save()
        self.picks.append(pick)
        return pick

    def choose_quantized_rows(self, weights: list[QuantizedWeight]) -> None:
        """weights=...: time one row's product with each quantized weight shape (the int8 LM
        head; every projection, int8 or int4) through torch's kernel and the C++ one, over
        streamed copies; shapes where the C++ one wins take it for products of up to
        KERNEL_ROWS rows."""
        candidates = {"torch": gemm.linear, "fused": quantized_rows.linear}
        store = None
        for kind in ("int8", "int4"):
            timed = [w for w in weights if w.kind == kind and quantized_rows.takes(w)]
            if not timed or not quantized_rows.available(kind):
                continue
            store = store or TimingStore.open()
            source = f"{kind} {quantized_rows.LIBRARY.source_hash()}"
            for shape, weight in one_per_shape(timed).items():
                pick = store.get_or_time(Pick(f"{kind}-rows", shape, 1, "torch"), self.dtype,
                                         candidates,
                                         lambda w=weight: _time_linear(candidates, w, 1), source)
                self.picks.append(pick)
                self.quantized_rows_seconds[(kind, shape)] = dict(pick.seconds)
                if pick.kernel == "fused":
                    self.quantized_rows_shapes.add((kind, shape))
        if store is not None:
            store.save()

    def choose_graph_decode_attention(self, heads: tuple[int, int, int], kv_head_of_q: list[int],
                                      block_size: int, max_context: int) -> None:
        """compile=True on a CPU: time one decode row's KV store and attention per layer, as
        the decode graph runs them (engine.rank.padded_decode), each compiled: the graph's own
        tensor math over the block table (the built-in) and one call to the fused kernel
        (engine.rank.fused_attention.paged_decode); graphs compiled afterwards take the pick.
        Timed at GRAPH_DECODE_CONTEXT keys (fewer where the model's context is shorter)."""
        if not (fused_attention.takes_paged_decode(self.dtype, heads[2], kv_head_of_q)
                and fused_attention.available()):
            return
        context = max(1, min(GRAPH_DECODE_CONTEXT, max_context))
        pick = self._compiled_pick(
            Pick("graph-decode-attention", heads, context, "tensor-math"),
            dict.fromkeys(("tensor-math", "fused")),
            lambda: _time_decode_in_graph(heads, block_size, context, self.dtype),
            f"fused {fused_attention.source_hash()}", "the decode graph's attention",
            "its tensor math")
        self.graph_decode_fused = pick is not None and pick.kernel == "fused"

    def choose_graph_steps(self, steps: dict[str, tuple[int, dict[str, Callable[[], object]], str]],
                           model_shape: tuple[int, ...], setup: str,
                           rounds: int = 3) -> dict[str, str]:
        """compile=True on one rank: each kind of step ("prompt", "decode": its row count, a run
        of one each way it can take: "graph" (its compiled graphs), "eager", and for a float
        model's decode steps where the C++ layers take them "one-call"; and the way kept unless
        another is faster by MARGIN (a prompt: by GRAPH_PROMPT_MARGIN)) timed every way,
        alternated; the way each kind runs. A fixed number of runs (`rounds`). Kept on disk
        like the other timings, under the model's shape and the settings a step's speed depends
        on (`setup`): timing whole steps took 2-3 s of every compiled start-up of SmolLM2 on the
        AMX Xeon."""
        store, ways = TimingStore.open(), {}
        for kind, (rows, candidates, built_in) in steps.items():
            pick = store.get_or_time(_graph_step_pick(kind, model_shape, rows, built_in),
                                     self.dtype, candidates,
                                     partial(_time_step, kind, candidates, rounds), setup)
            self.picks.append(pick)
            ways[kind] = pick.kernel
        store.save()
        return ways

    def kept_eager_steps(self, steps: dict[str, tuple[int, Iterable[str], str]],
                         model_shape: tuple[int, ...], setup: str) -> dict[str, str] | None:
        """The ways each kind of step runs where timings kept by choose_graph_steps (same
        kinds, ways, shape and `setup`) say no kind runs through its graphs; None where one
        does or a kind has no kept timing. Nothing is timed."""
        store, picks = TimingStore.open(), []
        for kind, (rows, ways, built_in) in steps.items():
            pick = _graph_step_pick(kind, model_shape, rows, built_in)
            if not store.kept(pick, self.dtype, ways, setup) or pick.kernel == "graph":
                return None
            picks.append(pick)
        self.picks.extend(picks)
        return {kind: pick.kernel for kind, pick in zip(steps, picks)}

    def choose_decode_call(self, candidates: dict[str, Callable[[], object]], built_in: str,
                           model_shape: tuple[int, ...],
                           first_rank: Callable[[dict[str, float]], dict[str, float]],
                           setup: str | None, rounds: int = 3) -> str:
        """A CPU rank whose decode steps no graph timing offered the C++ layers (eager, or
        tp > 1): a decode step of one row run each way in `candidates`, alternated, `rounds`
        runs each, on every rank at once (their sums pair the ranks' steps up); the way kept
        unless another is faster by MARGIN, decided on rank 0's timings (`first_rank` hands
        them to every rank: ranks that chose apart would sum differently made steps). Kept on
        disk under `setup` where one rank runs; None (tp > 1): timed at every start, as a kept
        timing on one rank and none on another would have them run different steps."""
        pick = Pick("decode-steps", model_shape, 1, built_in)

        def measure() -> dict[str, float]:
            return first_rank(_time_step("decode", candidates, rounds))

        if setup is None:
            pick.seconds = measure()
        else:
            store = TimingStore.open()
            store.get_or_time(pick, self.dtype, candidates, measure, setup)
            store.save()
        self.picks.append(pick)
        return pick.kernel

    def _choose_decode_attention(self, store: "TimingStore", heads: tuple[int, int, int],
                                 max_context: int) -> None:
        kernels = decode_attention_kernels(self.dtype)
        if max_context < 1:
            return
        top = min(max_context, MAX_TIMED_CONTEXT)
        self._top_context_bucket = row_bucket(top)
        for bucket in range(row_bucket(top) + 1):
            keys = min(4 ** bucket, top)
            pick = store.get_or_time(Pick("decode-attention", heads, keys, "sdpa"), self.dtype,
                                     kernels, lambda: _time_attention(heads, keys, self.dtype,
                                                                      kernels, queries=1))
            self.picks.append(pick)
            self._decode_attention[(self.dtype, bucket)] = kernels[pick.kernel]

    def _plain(self, shape: tuple[int, ...], bucket: int) -> str:
        """What a packed copy's timing against the plain weight depends on: the plain weight's
        kernel (its pick), so a kept timing of another pick's is measured again."""
        return f"plain {self._linear_names[(*shape, bucket)]}"

    def _choose_decode_copies(self, store: "TimingStore", weights: list[torch.Tensor]) -> None:
        """Time one row against each weight as it is (its 1-row pick) and packed for one row;
        shapes where packed wins get packed copies for decode steps (engine.rank.decode_weights)."""
        if self.dtype not in DECODE_COPY_DTYPES or not gemm.onednn_runs(self.dtype):
            return
        for shape, weight in one_per_shape(weights).items():
            candidates = {"plain": self._linear[(*shape, 0)], "packed": gemm.eager_onednn_linear}
            pick = store.get_or_time(
                Pick("decode-weights", shape, 1, "plain"), self.dtype, candidates,
                lambda: _time_linear(candidates, weight, 1,
                                     prepare={"packed": partial(gemm.pack_for_rows, rows=1)}),
                setup=self._plain(shape, 0))
            self.picks.append(pick)
            if pick.kernel == "packed":
                self.packed_decode_shapes.add(shape)

    def _choose_prompt_copies(self, store: "TimingStore", weights: list[torch.Tensor],
                              max_tokens: int, lm_head_shape: tuple[int, ...] | None) -> None:
        """For each projection shape (the LM head's aside: prompts sample few rows), time one
        product of a prompt's rows as the picks run it on the plain weight, and through oneDNN
        on a copy packed for those rows. Shapes where packed wins are in
        `packed_prompt_shapes` (the rank copies their weights: engine.rank.gemm.PromptCopies),
        and their products of more than gemm.PLAIN_WEIGHT_ROWS rows go to oneDNN, which reads
        the copies. Decided shape by shape: in bf16 on the AMX Xeon, copies ran the 960- and
        3072-row SmolLM2 weights faster at 512 rows and the 576-row ones slower, and one
        choice for all of them kept every weight plain."""
        shapes = {s: w for s, w in one_per_shape(weights).items() if s != lm_head_shape}
        rows = min(PROMPT_COPY_ROWS, max_tokens)
        if (self.dtype not in (torch.float32, torch.bfloat16) or not gemm.onednn_runs(self.dtype)
                or not shapes or rows <= gemm.PLAIN_WEIGHT_ROWS):
            return
        copy_bytes = sum(w.nbytes for w in weights if tuple(w.shape) in shapes)
        available = available_bytes()
        if available is not None and copy_bytes > PROMPT_COPY_MEMORY * available:
            log.info("no packed prompt copies: %.1f GiB of them, %.1f GiB of memory available",
                     copy_bytes / 2**30, available / 2**30)
            return
        bucket = min(row_bucket(rows), self._top_bucket)
        first = row_bucket(gemm.PLAIN_WEIGHT_ROWS + 1)
        self.prompt_copy_rows = rows
        for shape, weight in shapes.items():
            plain = self._linear[(*shape, bucket)]
            pick = store.get_or_time(
                Pick("prompt-weights", shape, rows, "plain", margin=PROMPT_COPY_MARGIN),
                self.dtype, dict.fromkeys(("plain", "packed")),
                lambda: _time_prompt_copy(plain, weight, rows), setup=self._plain(shape, bucket))
            self.picks.append(pick)
            if pick.kernel == "packed":
                self.packed_prompt_shapes.add(shape)
                for b in range(first, self._top_bucket + 1):
                    self._linear[(*shape, b)] = gemm.eager_onednn_linear

    def _choose_gated_prompts(self, store: "TimingStore", weights: list[torch.Tensor],
                              gate_up_shape: tuple[int, ...] | None) -> None:
        """Where prompts read packed copies of the gate/up weight, time its product at their
        rows with the SiLU·mul fused into oneDNN's (packed halves) and after it (packed
        whole); `gated_prompt_shape` says where fused won (the rank packs halves instead)."""
        shape = gate_up_shape
        if shape not in self.packed_prompt_shapes or shape[0] % 2:
            return
        weight = one_per_shape(weights)[shape]
        rows = self.prompt_copy_rows
        pick = store.get_or_time(
            Pick("gated-prompt", shape, rows, "whole", margin=GATED_MARGIN), self.dtype,
            dict.fromkeys(("whole", "halves")), lambda: _time_gated(weight, rows))
        self.picks.append(pick)
        if pick.kernel == "halves":
            self.gated_prompt_shape = shape

    def applied_to(self, backend: Backend) -> Backend:
        """`backend` with its projections, and the torch backend's attention (prompt and decode
        steps), asking this choice first."""
        if backend.attention is not torch_attention:  # Triton's own attention
            return dataclasses.replace(backend, linear=self.linear)
        chosen = partial(torch_attention, prompt_kernel=self.prompt_kernel,
                         decode_kernel=self.decode_kernel)
        return dataclasses.replace(backend, linear=self.linear, attention=chosen,
                                   decode_attention=chosen,
                                   gated_linear=partial(self.gated_linear,
                                                        silu_mul=backend.silu_mul))

    def describe(self) -> list[str]:
        return [p.describe() for p in self.picks]


def _time_linear(kernels: dict[str, Callable], weight: torch.Tensor, rows: int,
                 prepare: dict[str, Callable] | None = None) -> dict[str, float]:
    """Seconds per product. A few rows' product is bound by reading the weight, which a step
    reads from memory (every layer's weights differ): such buckets are timed over copies of the
    weight that together outgrow the caches, not one weight the cache keeps hot. `prepare`:
    the weight a candidate reads, made from the plain one (a packed layout)."""
    count = min(MAX_COPIES, max(1, STREAMED_BYTES // weight.nbytes))
    copies = [weight.clone() for _ in range(count)] if rows <= STREAMED_ROWS else [weight]
    read = {name: [(prepare or {}).get(name, lambda w: w)(w) for w in copies] for name in kernels}
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    seconds = fastest({name: (lambda k=k, ws=read[name]: [k(x, w, None) for w in ws])
                       for name, k in kernels.items()})
    return {name: s / len(copies) for name, s in seconds.items()}


def _time_prompt_copy(plain: Callable, weight: torch.Tensor, rows: int) -> dict[str, float]:
    """Seconds for one product of `rows` rows with the weight: its `plain` kernel on the
    weight as it is ("plain"), and oneDNN's on a copy packed for `rows` rows ("packed")."""
    packed = gemm.pack_for_rows(weight, rows)
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    return fastest({"plain": lambda: plain(x, weight, None),
                    "packed": lambda: gemm.eager_onednn_linear(x, packed)})


def _time_gated(weight: torch.Tensor, rows: int) -> dict[str, float]:
    """Seconds for one gate/up product of `rows` rows with its SiLU·mul: oneDNN on a copy packed
    whole, then the SiLU·mul ("whole"), and on packed halves, the SiLU·mul applied inside
    ("halves")."""
    whole = gemm.pack_for_rows(weight, rows)
    halves = gemm.pack_halves(weight, rows)
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    return fastest({"whole": lambda: ops.silu_mul(gemm.eager_onednn_linear(x, whole)),
                    "halves": lambda: gemm.gated_halves(x, *halves)})


def _time_step(kind: str, candidates: dict[str, Callable[[], object]],
               rounds: int) -> dict[str, float]:
    # exactly `rounds` runs each: a fixed count, whatever the times (`kind` names the step
    # for a stand-in timing: the tests make a given kind win)
    return fastest(candidates, min_rounds=rounds, min_seconds=0.0, max_rounds=rounds)


def _one_row_products(kernel: Callable, xs: dict[int, torch.Tensor],
                      weights: list[torch.Tensor]) -> list[torch.Tensor]:
    return [kernel(xs[w.shape[1]], w, None) for w in weights]


_row_timings = itertools.count()  # each timing compiles code of its own (below)


def _time_in_graph(kernels: dict[str, Callable], weights: list[torch.Tensor]) -> dict[str, float]:
    """Seconds for one row through copies of every weight (STREAMED_BYTES in all, up to
    MAX_GRAPH_COPIES; one copy when the weights alone are more), each candidate compiled as one
    static graph, as a decode graph runs its projections."""
    from engine.rank.compiled import own_code  # which imports this module

    keep_compiled_code()
    count = max(1, min(MAX_GRAPH_COPIES, STREAMED_BYTES // sum(w.nbytes for w in weights)))
    copies = [w.clone() for _ in range(count) for w in weights]
    xs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in copies}
    # code of its own per candidate and timing: dynamo keeps 8 graphs per code object, and a
    # process starting a few engines times here a few times (fullgraph: the 9th would fail)
    timing = next(_row_timings)
    graphs = {name: partial(torch.compile(own_code(_one_row_products, f"timing{timing}_{i}"),
                                          dynamic=False, fullgraph=True), k, xs, copies)
              for i, (name, k) in enumerate(kernels.items())}
    return fastest(graphs)


def _store_and_attend_layers(ctx: StepContext, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, scale: float) -> list[torch.Tensor]:
    """What a decode graph's layers do to the cache: store one row's K/V, then attend."""
    out = []
    for layer in range(ctx.cache.data.shape[1]):
        ctx.ops.store(ctx, layer, k, v)
        out.append(ctx.ops.attend(ctx, layer, q, k, v, scale))
    return out


_decode_timings = itertools.count()  # each timing compiles code of its own (below)


def _time_decode_in_graph(heads: tuple[int, int, int], block_size: int, context: int,
                          dtype: torch.dtype) -> dict[str, float]:
    """Seconds per layer for one decode row's store and attention over `context` keys, through
    each of the decode graph's ops (engine.rank.padded_decode): TIMED_DECODE_LAYERS layers of
    distinct caches in one compiled graph, so its call's own cost is shared as a step's is."""
    keep_compiled_code()
    num_q, num_kv, head_dim = heads
    width = max(2, -(-context // block_size))
    cache = KVCache(TIMED_DECODE_LAYERS, width, block_size, num_kv, head_dim, dtype,
                    torch.device("cpu"))
    cache.data.normal_()
    ints = partial(torch.tensor, dtype=torch.int32)
    meta = PaddedDecode(ints([context - 1]), ints([list(range(width))]), ints([context]),
                        torch.tensor([h // (num_q // num_kv) for h in range(num_q)]))
    q = torch.randn(1, num_q, head_dim, dtype=dtype)
    k, v = (torch.randn(1, num_kv, head_dim, dtype=dtype) for _ in range(2))
    step = partial(padded_context, ints([0]), ints([context - 1]), meta, cache, False)
    from engine.rank.compiled import own_code  # which imports this module

    # code of its own per timing, so engines of other shapes in one process do not use up
    # dynamo's graphs for it; the function itself compiled, not a partial of it (dynamo wraps
    # every partial in one shared piece of code)
    compiled = torch.compile(own_code(_store_and_attend_layers, f"timing{next(_decode_timings)}"),
                             dynamic=False, fullgraph=True)
    graphs = {name: partial(compiled, step(fused=name == "fused"), q, k, v, head_dim ** -0.5)
              for name in ("tensor-math", "fused")}
    for run in graphs.values():  # compiled, its guards checked once
        run()
    # then run as a decode graph runs once trusted (engine.rank.compiled): guards unchecked
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
        seconds = fastest(graphs)
    return {name: s / TIMED_DECODE_LAYERS for name, s in seconds.items()}


def _graph_step_pick(kind: str, model_shape: tuple[int, ...], rows: int, built_in: str) -> Pick:
    margin = GRAPH_PROMPT_MARGIN if kind == "prompt" else MARGIN
    return Pick(f"graph-{kind}", model_shape, rows, built_in, margin=margin)


def _time_attention(heads: tuple[int, int, int], tokens: int, dtype: torch.dtype,
                    kernels: dict[str, Callable], queries: int | None = None) -> dict[str, float]:
    """`queries` of `tokens` keys (all of them: a whole prompt's causal attention)."""
    num_q, num_kv, head_dim = heads
    q = torch.randn(queries or tokens, num_q, head_dim, dtype=dtype)
    k, v = (torch.randn(tokens, num_kv, head_dim, dtype=dtype) for _ in range(2))
    return fastest({name: (lambda a=a: a(q, k, v, head_dim ** -0.5))
                    for name, a in kernels.items()}, min_rounds=3)


def machine_key() -> str:
    """What a timing depends on besides the shape: the CPU model and its vector extensions,
    the torch build and the threads it runs."""
    return f"{cpu_description()}|torch {torch.__version__}|{torch.get_num_threads()} threads"


def keep_compiled_code() -> str:
    """Where inductor keeps the code it generates: the engine's cache folder (beside the kernel
    timings), so a start-up after a reboot or a cleaned /tmp (torch's default) finds its
    graphs compiled. A folder the user or an earlier compile in this process chose is kept,
    so this runs before a rank's first compile (inductor fixes its folder then)."""
    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))


TIMING_METHOD = "v2"  # part of each kept timing's key: a change of method measures again


def _kept_seconds(entry: object, candidates: Iterable[str]) -> dict[str, float] | None:
    """A kept entry's times where it holds one (a positive number) for exactly these
    candidates; else None (measured again, never trusted)."""
    if not isinstance(entry, dict):
        return None
    seconds = entry.get("seconds")
    if (isinstance(seconds, dict) and set(seconds) == set(candidates)
            and all(isinstance(s, (int, float)) and s > 0 for s in seconds.values())):
        return dict(seconds)
    return None


class TimingStore:
    """Timings kept on disk, one JSON file; an entry that does not read back as the same
    candidates' times is measured again, never trusted."""

    def __init__(self, path: Path, entries: dict):
        self.path, self.entries, self.changed = path, entries, False
        # The process's OpenMP is part of every key (engine.cpu_runtime): it changes how fast
        # every parallel region starts, so a timing taken under one is not trusted under the
        # other. Asked once: asking reads the process's maps and looks up the libraries.
        self.machine = f"{machine_key()}|{cpu_runtime.openmp()} openmp"

    @classmethod
    def open(cls) -> "TimingStore":
        path = cache_dir() / "kernel_timings.json"
        return cls(path, read_whole(path))

    def get_or_time(self, pick: Pick, dtype: torch.dtype, candidates: dict[str, Callable],
                    measure: Callable[[], dict[str, float]], setup: str = "") -> Pick:
        """`pick` with the kept timings of exactly these candidates, or with new ones. `setup`:
        what else the timing depends on, beyond the machine, the op and its shape. A kept
        timing older than REMEASURE_AFTER is measured again, each candidate keeping the better
        of its two times."""
        if self.kept(pick, dtype, candidates, setup):
            return pick
        key = self._key(pick, dtype, setup)
        earlier = _kept_seconds(self.entries.get(key), candidates) or {}
        pick.seconds = {name: min(s, earlier.get(name, s)) for name, s in measure().items()}
        self.entries[key] = {"seconds": pick.seconds, "timed": time.time()}
        self.changed = True
        return pick

    def kept(self, pick: Pick, dtype: torch.dtype, candidates: Iterable[str],
             setup: str = "") -> bool:
        """Whether kept timings of exactly these candidates, taken less than REMEASURE_AFTER
        ago, fill `pick` (nothing timed)."""
        entry = self.entries.get(self._key(pick, dtype, setup))
        seconds = _kept_seconds(entry, candidates)
        if seconds is None or measured_long_ago(entry.get("timed")):
            return False
        pick.seconds, pick.from_disk = seconds, True
        return True

    def _key(self, pick: Pick, dtype: torch.dtype, setup: str) -> str:
        key = f"{TIMING_METHOD}|{self.machine}|{pick.op}|{dtype}|{pick.shape}|{pick.rows}"
        return key + (f"|{setup}" if setup else "")

    def save(self) -> None:
        """Written whole, through a rename, so a reader never sees half a file; two ranks saving
        at once lose at most each other's new entries (measured again next time)."""
        if self.changed:
            write_whole(self.path, self.entries)
