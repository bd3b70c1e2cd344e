"""Log-probabilities of given target tokens under logits split by vocabulary over ranks.

Each rank holds the logits of its own vocabulary slice only. Per position, every rank puts its
local maximum, its sum of exp(logit - local max) and (on the one rank that owns the target) the
target's logit into its own rows of one small tensor; a single all-reduce then hands every rank
all of them, and log-sum-exp follows from merging the partial sums. The top-k candidates are each
rank's own top-k, gathered to rank 0 and merged there. No rank ever holds the [T, vocab] logits:
positions are processed in slices whose local logits stay under a byte budget.

Like `parallel.comm`, this works for a world of one with no process group at all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from parallel import comm
from parallel.partition import Range

# bytes of float32 local logits held at once; 16 MiB is ~85 rows of a 49k vocabulary
SLICE_BYTES = 16 * 2**20


@dataclass(slots=True)
class LogprobRows:
    """Per scored position: log p(target), and on rank 0 the top-k (id, log p) candidates."""

    logprobs: torch.Tensor  # float32 [n]
    top_ids: torch.Tensor | None = None  # int64 [n, k], most likely first (rank 0 only)
    top_logprobs: torch.Tensor | None = None  # float32 [n, k]
    peak_logits_bytes: int = 0  # largest logits slice this rank held at once


def rows_per_slice(local_vocab: int, slice_bytes: int = SLICE_BYTES) -> int:
    """How many positions' float32 local logits fit in `slice_bytes` (at least one)."""
    return max(1, slice_bytes // (4 * max(1, local_vocab)))


def vocab_parallel_logprobs(local_logits: Callable[[int, int], torch.Tensor], num_rows: int,
                            targets: torch.Tensor, vocab_slice: Range, top_k: int = 0,
                            slice_bytes: int = SLICE_BYTES) -> LogprobRows:
    """log p(targets[i]) for rows 0..num_rows-1, computed slice by slice.

    `local_logits(a, b)` returns this rank's logits [b - a, local vocab] for rows a..b-1 (any
    float dtype; computed on demand, so only one slice lives at a time, and overwritten here, so
    return a fresh tensor, not a view of one kept elsewhere). `vocab_slice` is
    the [start, stop) of vocabulary ids this rank holds. Every rank must call this with the same
    rows, targets and top_k: the collectives pair up across ranks.
    """
    start, stop = vocab_slice
    step = rows_per_slice(stop - start, slice_bytes)
    logprobs, top_ids, top_lps, peak = [], [], [], 0
    for a in range(0, num_rows, step):
        b = min(num_rows, a + step)
        logits = local_logits(a, b)
        # a half-precision slice briefly lives next to its float32 copy
        peak = max(peak, logits.numel() * 4 + (0 if logits.dtype == torch.float32 else logits.nbytes))
        lp, ids, lps = _slice_logprobs(logits.float(), targets[a:b], start, top_k)
        logprobs.append(lp)
        if ids is not None:
            top_ids.append(ids)
            top_lps.append(lps)
    out = LogprobRows(torch.cat(logprobs) if logprobs else torch.empty(0), peak_logits_bytes=peak)
    if top_ids:
        out.top_ids, out.top_logprobs = torch.cat(top_ids), torch.cat(top_lps)
    return out


def _slice_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, top_k: int):
    """One slice: [rows, local vocab] float32 logits (overwritten) -> log p(target), top-k."""
    rows, width = logits.shape
    world, rank = comm.world_size(), comm.rank()
    local_max = logits.max(dim=-1).values
    # the target's logit, from the rank whose slice holds it (zero elsewhere, so a sum picks it)
    offset = targets.to(logits.device) - vocab_start
    mine = (offset >= 0) & (offset < width)
    target = logits.gather(-1, (offset * mine).unsqueeze(-1)).squeeze(-1) * mine
    top = _local_top_k(logits, top_k, vocab_start) if top_k else None
    # in place: the exponentials reuse the logits' memory, so one slice is the peak
    local_sum = logits.sub_(local_max.unsqueeze(-1)).exp_().sum(dim=-1)
    # rows [0, W): each rank's max; [W, 2W): each rank's sum of exps; 2W: the target's logit
    parts = torch.zeros(2 * world + 1, rows, device=logits.device)
    parts[rank], parts[world + rank], parts[2 * world] = local_max, local_sum, target
    comm.all_reduce(parts)
    maxima, sums = parts[:world], parts[world:2 * world]
    global_max = maxima.max(dim=0).values
    lse = global_max + (sums * torch.exp(maxima - global_max)).sum(dim=0).log()
    logprobs = parts[2 * world] - lse
    if top is None:
        return logprobs, None, None
    ids, lps = _merge_top_k(*top, top_k)
    return logprobs, ids, None if lps is None else lps - lse.unsqueeze(-1)


def _local_top_k(logits: torch.Tensor, k: int, vocab_start: int):
    """This rank's k best (logit, global id) per row, padded with -inf where its slice is
    narrower than k so every rank sends the same shape."""
    local = min(k, logits.shape[-1])
    values, ids = logits.topk(local, dim=-1)
    ids = ids + vocab_start
    if local < k:
        values = torch.nn.functional.pad(values, (0, k - local), value=float("-inf"))
        ids = torch.nn.functional.pad(ids, (0, k - local), value=-1)
    return values, ids


def _merge_top_k(values: torch.Tensor, ids: torch.Tensor, k: int):
    """Rank 0 merges every rank's k best into the global k best (None, None elsewhere)."""
    world = comm.world_size()
    all_values = comm.gather_last_dim(values.contiguous(), [k] * world)
    all_ids = comm.gather_last_dim(ids.contiguous(), [k] * world)
    if all_values is None:
        return None, None
    best, where = all_values.topk(k, dim=-1)
    return all_ids.gather(-1, where), best
