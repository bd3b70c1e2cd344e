"""The rank's warm-up: the shapes its steps will take, run before any request arrives, so that
torch.compile's and Triton's compiling and autotuning happen at start-up, never inside a
request's step timeout."""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, Sequence

from engine.batch import Batch, SamplingSpec
from engine.rank.compiled import DECODE_BUCKETS, CompiledModel

log = logging.getLogger("engine")
RunStep = Callable[[Batch], object]


def warm_up(run: RunStep, block_size: int, max_len: int, compiled: CompiledModel | None = None,
            tuning_steps: Sequence[tuple[int, int]] = (),
            decode_rows: Sequence[int] = DECODE_BUCKETS) -> float:
    """Run the shapes steps take (prompts, a decode step of each of `decode_rows` sequences,
    the autotuner's (tokens per sequence, sequences) steps), all within `max_len` positions;
    seconds taken. If compiling fails, the rank stays eager."""
    start = time.perf_counter()
    if compiled is not None:
        try:
            _run_shapes(run, block_size, max_len, decode_rows, tuning_steps)
            return time.perf_counter() - start
        except Exception as e:  # noqa: BLE001  an unsupported setup must not stop the engine
            compiled.usable = False
            first = str(e).splitlines()[0] if str(e) else ""
            folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            # a compile killed midway leaves a cut file that fails every later start
            hint = (f"; if a file it names is cut short, delete {folder} to compile afresh"
                    if folder and folder in str(e) else "")
            log.warning("compiling the layers failed on this setup (%s: %s); running eagerly "
                        "instead%s; compile=False skips compiling", type(e).__name__, first, hint)
    _run_shapes(run, block_size, max_len, (1,), tuning_steps)
    return time.perf_counter() - start


def _run_shapes(run: RunStep, block_size: int, max_len: int, decode_rows: Sequence[int],
                tuning_steps: Sequence[tuple[int, int]]) -> None:
    """Two prompt lengths, the tuning steps, then a decode step after the longer prompt's
    context, for each of `decode_rows` sequence counts."""
    prompts = sorted({min(16, max_len), min(48, max_len)})
    for num_tokens in prompts:
        run(warm_up_batch(num_tokens, 0, 1, block_size))
    for num_tokens, num_seqs in tuning_steps:
        run(warm_up_batch(num_tokens, 0, num_seqs, block_size))
    for num_seqs in decode_rows:
        run(warm_up_batch(1, min(48, max_len - 1), num_seqs, block_size))


def warm_up_batch(num_tokens: int, start: int, num_seqs: int, block_size: int) -> Batch:
    """A step of `num_seqs` sequences of made-up tokens, all in the first blocks, which no
    request holds yet (their slots are overwritten when a request gets them). Every rank runs
    it at once (SPMD)."""
    positions = list(range(start, start + num_tokens)) * num_seqs
    blocks = list(range(-(-(start + num_tokens) // block_size)))
    return Batch([0] * len(positions), positions, list(range(0, len(positions) + 1, num_tokens)),
                 [start + num_tokens] * num_seqs, positions, [blocks] * num_seqs,
                 list(range(num_tokens - 1, len(positions), num_tokens)),
                 [SamplingSpec()] * num_seqs)
