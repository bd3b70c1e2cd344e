"""CUDA graphs of the compiled decode step: a decode step replayed as one graph launch.

A decode step on a GPU is launch-bound: a few hundred small kernels, each microseconds of work.
A captured graph replays them all with one launch. A graph fixes every shape and address, so:

- one graph per (row bucket, table width): rows are padded to the compiled decode graph's
  buckets (as padded_decode does), the block table to a power-of-two width, at least 2 (a
  context grows into the next width every doubling: log2(max_model_len / block) widths);
- the step's inputs live in one static int32 buffer per graph (token ids, positions, slots,
  context lengths, the table), refilled in place by the step's one pinned copy before the
  replay; the KV cache and the weights are static already (the cache is updated in place);
- every graph is captured in the warm-up, after compiling, so no capture happens inside a
  request; a step no graph fits (more rows than the largest bucket) runs the uncaptured
  compiled graph, and so does every step if capturing failed (one warning).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from engine.batch import Batch
from engine.rank.kv_cache import KVCache
from engine.rank.padded_decode import PaddedDecode, padded_context, padded_lists
from engine.rank.step_context import StepContext

log = logging.getLogger("engine")
DecodeFn = Callable[[StepContext], torch.Tensor]
FIELDS = ("ids", "positions", "slots", "lens")  # one value per row (padded_lists); then the table


def table_width(max_context: int, block_size: int) -> int:
    """The power-of-two table width (>= 2) a step whose longest context is `max_context` uses."""
    blocks = max(2, -(-max_context // block_size))
    return 1 << (blocks - 1).bit_length()


def widths_up_to(max_model_len: int, block_size: int) -> list[int]:
    """Every width a step within `max_model_len` can need."""
    widths, w = [], 2
    while w <= table_width(max_model_len, block_size):
        widths.append(w)
        w *= 2
    return widths


def padded_inputs(batch: Batch, rows: int, width: int) -> list[int]:
    """The static buffer's contents: padded_decode's padded integers, laid end to end in
    FIELDS order, then the table."""
    return [v for values in padded_lists(batch, rows, width).values() for v in values]


@dataclass(slots=True)
class Captured:
    graph: object  # torch.cuda.CUDAGraph
    inputs: torch.Tensor  # the static int32 buffer the graph reads
    ctx: StepContext  # its step context: views of `inputs`
    logits: torch.Tensor  # [rows, local vocab] the graph writes


class DecodeGraphs:
    """The captured decode steps of one rank."""

    def __init__(self, run: DecodeFn, cache: KVCache, kv_head_of_q: torch.Tensor,
                 decode_weights: bool = False):
        self.run, self.cache, self.kv_head_of_q = run, cache, kv_head_of_q
        self.device, self.decode_weights = kv_head_of_q.device, decode_weights
        self.graphs: dict[tuple[int, int], Captured] = {}
        self.usable = True
        self._pool = None

    def capture(self, buckets: Sequence[int], widths: Sequence[int]) -> None:
        """Capture every (bucket, width) graph; on any failure use none of them."""
        try:
            self._pool = torch.cuda.graph_pool_handle()
            for rows in buckets:
                for width in widths:
                    self.graphs[(rows, width)] = self._capture_one(rows, width)
        except Exception as e:  # noqa: BLE001  the uncaptured graph still serves every step
            self.usable, self.graphs = False, {}
            log.warning("CUDA graph capture failed (%s: %s); decode steps run uncaptured",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")

    def _context(self, inputs: torch.Tensor, rows: int, width: int) -> StepContext:
        ids, positions, slots, lens = (inputs[i * rows:(i + 1) * rows] for i in range(4))
        meta = PaddedDecode(slots, inputs[4 * rows:].view(rows, width), lens, self.kv_head_of_q)
        return padded_context(ids, positions, meta, self.cache, self.decode_weights)

    def _capture_one(self, rows: int, width: int) -> Captured:
        # a valid step: every row a one-token context in block 0 (which no request holds yet)
        inputs = torch.zeros(rows * (len(FIELDS) + width), dtype=torch.int32, device=self.device)
        inputs[3 * rows:4 * rows] = 1  # context lengths
        ctx = self._context(inputs, rows, width)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # a run before capturing, as CUDA graphs require
            self.run(ctx)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.run(ctx)
        return Captured(graph, inputs, ctx, logits)

    def load(self, batch: Batch, rows: int) -> StepContext | None:
        """The context of the graph that fits this step, its inputs refilled with the step's
        (one pinned copy); None: no graph fits it."""
        width = table_width(max(batch.context_lens), self.cache.block_size)
        captured = self.graphs.get((rows, width)) if self.usable else None
        if captured is None:
            return None
        host = torch.tensor(padded_inputs(batch, rows, width), dtype=torch.int32).pin_memory()
        captured.inputs.copy_(host, non_blocking=True)  # in place: the graph reads this storage
        return captured.ctx

    def replay(self, ctx: StepContext) -> torch.Tensor | None:
        """Every row's logits slice of a captured graph's context; None: not one of theirs."""
        captured = self.graphs.get(tuple(ctx.meta.block_table.shape))
        if captured is None or captured.ctx is not ctx:
            return None
        captured.graph.replay()
        return captured.logits
