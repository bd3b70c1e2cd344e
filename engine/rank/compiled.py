"""`compile=True`: a rank's forward as torch.compile'd graphs, each a whole model.

- A decode step (one new token per sequence, at most `DECODE_BUCKETS[-1]` sequences, nothing
  scored) runs embedding, every layer, the final norm and this rank's slice of the LM head as
  one graph with static shapes: its rows are padded to the next size bucket, and each bucket is
  compiled once. Its float32 projections become streaming multiply-and-sum loops
  (parallel.gemm), its paged attention is tensor math over the block table (padded_decode) and
  its small ops fuse, so the step is the weight reads plus little else.
- Any other step of more than MATVEC_ROWS tokens runs the layers as one graph with a dynamic
  token count; shorter ones (rare) run eagerly.

Nothing breaks a graph: the KV store (and, in the layers graph, attention with it) and the
all-reduce are registered custom ops (graph_ops, parallel.comm). Compilation (and Triton's,
for the triton backend) happens in a warm-up when the rank starts, never inside a request's
step timeout; a failed compile falls back to eager with one warning. Tracing (the
walkthrough) runs eagerly.
"""
from __future__ import annotations

import bisect
import logging
import time
import types
from typing import Callable, Sequence

import torch
from torch import nn

from engine.batch import Batch
from engine.rank import graph_ops
from engine.rank.attention import StepContext
from engine.rank.cuda_graphs import DecodeGraphs, widths_up_to
from engine.rank.kv_cache import KVCache
from engine.rank.padded_decode import PaddedDecode, pad_decode_step
from parallel.gemm import MATVEC_ROWS

log = logging.getLogger("engine")
DECODE_BUCKETS = (1, 2, 4, 8)


class CompiledModel:
    """A rank's two kinds of graph, and which steps take which."""

    def __init__(self, model: nn.Module, backend):
        self.model, self.backend = model, backend
        self.usable = True  # False once compiling failed here: eager from then on
        self.enabled = True  # off while the tracer watches the eager modules
        # torch.compile keeps graphs (and a limit of 8 recompiles) per code object: each kind
        # of graph of each rank gets a code object of its own, so engines of other shapes in
        # this process never push this one's graphs out to eager
        self._layers = torch.compile(_own_code(_layers), fullgraph=True)  # token count dynamic
        self._decode = torch.compile(_own_code(_decode), dynamic=False, fullgraph=True)
        self.cuda_graphs: DecodeGraphs | None = None  # on CUDA, once captured

    def capture_decode_graphs(self, cache: KVCache, kv_head_of_q: torch.Tensor,
                              max_model_len: int) -> None:
        """On CUDA, after the warm-up compiled the decode graphs: capture each bucket at each
        table width, so decode steps replay instead of launching kernel by kernel."""
        def run(token_ids, positions, meta):
            torch._dynamo.mark_dynamic(meta.block_table, 1)  # one graph for every width
            with torch.no_grad():
                return self._decode(self.model, token_ids, positions, meta)

        self.cuda_graphs = DecodeGraphs(run, cache, kv_head_of_q, kv_head_of_q.device)
        self.cuda_graphs.capture(DECODE_BUCKETS, widths_up_to(max_model_len, cache.block_size))

    @property
    def active(self) -> bool:
        return self.usable and self.enabled

    def runs_layers(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` (not a decode graph's) runs the layers graph. Steps
        of at most MATVEC_ROWS tokens run eagerly: with them in its range, the graph's token
        count could not tell its projections which product to take without a guard, and
        such steps (a prompt's last 2 tokens, say) are rare and short."""
        return self.active and num_tokens > MATVEC_ROWS

    @staticmethod
    def decode_bucket(num_seqs: int) -> int | None:
        """The padded row count of a decode step of `num_seqs` sequences (None: too many)."""
        at = bisect.bisect_left(DECODE_BUCKETS, num_seqs)
        return DECODE_BUCKETS[at] if at < len(DECODE_BUCKETS) else None

    def hidden_states(self, token_ids: torch.Tensor, positions: torch.Tensor,
                      ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        for rows in (token_ids, positions):  # > MATVEC_ROWS: the projections stay oneDNN's
            torch._dynamo.mark_dynamic(rows, 0, min=MATVEC_ROWS + 1, max=2**24)
        with graph_ops.running(ctx, self.backend):
            return self._layers(self.model, token_ids, positions, ctx)

    def decode_logits(self, batch: Batch, cache: KVCache, kv_head_of_q: torch.Tensor,
                      rows: int) -> torch.Tensor:
        """This rank's logits slice for each sequence of a decode step, run as the graph of
        `rows` (>= the step's sequences) rows: replayed where a CUDA graph fits it."""
        if self.cuda_graphs is not None:
            logits = self.cuda_graphs.replay(batch, rows)
            if logits is not None:
                return logits
        token_ids, positions, meta = pad_decode_step(batch, cache, kv_head_of_q, rows,
                                                     kv_head_of_q.device)
        torch._dynamo.mark_dynamic(meta.block_table, 1)  # one graph for every context length
        with torch.no_grad():
            return self._decode(self.model, token_ids, positions, meta)[: batch.num_seqs]


def _own_code(fn: Callable) -> Callable:
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)


def _layers(model: nn.Module, token_ids: torch.Tensor, positions: torch.Tensor,
            ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
    return model.hidden_states(token_ids, positions, ctx)


def _decode(model: nn.Module, token_ids: torch.Tensor, positions: torch.Tensor,
            ctx: PaddedDecode) -> torch.Tensor:
    return model.local_logits(token_ids, positions, ctx)


def warm_up(run_step: Callable[[int, int, int], None], max_len: int,
            compiled: CompiledModel | None = None,
            tuning_steps: Sequence[tuple[int, int]] = ()) -> float:
    """Run the shapes steps take (prompts, a decode step of every bucket, the autotuner's
    (tokens per sequence, sequences) steps), all within `max_len` positions, before any request arrives,
    so torch.compile and Triton's compilation and autotuning happen here, not inside a request's
    step timeout; seconds taken. If compiling fails, the rank stays eager."""
    start = time.perf_counter()
    if compiled is not None:
        try:
            _run_shapes(run_step, max_len, DECODE_BUCKETS, tuning_steps)
            return time.perf_counter() - start
        except Exception as e:  # noqa: BLE001  an unsupported setup must not stop the engine
            compiled.usable = False
            log.warning("compile=True failed on this setup (%s: %s); running eagerly instead",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
    _run_shapes(run_step, max_len, (1,), tuning_steps)
    return time.perf_counter() - start


def _run_shapes(run_step: Callable[[int, int, int], None], max_len: int,
                decode_rows: tuple[int, ...], tuning_steps: Sequence[tuple[int, int]]) -> None:
    """run_step(tokens per sequence, start position, sequences): two prompt lengths, the
    tuning steps, then a decode step after the longer prompt's context."""
    prompts = sorted({min(16, max_len), min(48, max_len)})
    for num_tokens in prompts:
        run_step(num_tokens, 0, 1)
    for num_tokens, num_seqs in tuning_steps:
        run_step(num_tokens, 0, num_seqs)
    for num_seqs in decode_rows:
        run_step(1, min(48, max_len - 1), num_seqs)
