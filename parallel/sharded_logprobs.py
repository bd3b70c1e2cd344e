"""Log-probabilities of given target tokens under logits split by vocabulary over ranks.

Each rank holds the logits of its own vocabulary slice only, and computes them one tile at a time
(a slice of positions by a block of its vocabulary), keeping per position a running log-sum-exp
(max + log of the sum of exponentials), the target's logit if the tile holds it, and a running
top-k. Then one all-reduce per slice of positions hands every rank every rank's log-sum-exp (each
rank fills its own row of one small tensor) and the target's logit (only its owner adds a
non-zero), and the whole vocabulary's log-sum-exp follows from merging them. Top-k candidates
are each rank's own top-k, gathered to rank 0 and merged there. No rank ever holds the
[T, vocab] logits.

Tiles are as tall as the byte budget allows (all positions at once unless the prompt is very
long), so the LM-head weight is read about once however many positions are scored.

Like `parallel.comm`, this works for a world of one with no process group at all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from parallel import comm
from parallel.partition import Range

TILE_BYTES = 16 * 2**20  # float32 logits per tile; a tile and its log-softmax live at once
MIN_TILE_COLS = 1024  # positions are sliced only when this many columns of all of them overflow

# (row start, row stop, local column start, local column stop) -> that tile of this rank's logits
LogitsTile = Callable[[int, int, int, int], torch.Tensor]


@dataclass(slots=True)
class LogprobRows:
    """Per scored position: log p(target), and on rank 0 the top-k (id, log p) candidates."""

    logprobs: torch.Tensor  # float32 [n]
    top_ids: torch.Tensor | None = None  # int64 [n, k], most likely first (rank 0 only)
    top_logprobs: torch.Tensor | None = None  # float32 [n, k]
    peak_logits_bytes: int = 0  # largest logits tile this rank held at once


def tile_shape(num_rows: int, local_vocab: int, tile_bytes: int = TILE_BYTES) -> tuple[int, int]:
    """(rows, columns) of a float32 tile under `tile_bytes`: every row if MIN_TILE_COLS columns
    of them fit, else as many rows as do; then as many columns as fit, but at most 2/5 of the
    slice, so a tile, its log-softmax and a half-precision original (10 bytes a cell) stay under
    the 4 bytes a cell of the rows' full float32 logits would take."""
    cells = max(1, tile_bytes // 4)
    rows = max(1, min(num_rows, cells // min(MIN_TILE_COLS, local_vocab)))
    return rows, max(1, min(2 * local_vocab // 5, cells // rows))


def vocab_parallel_logprobs(local_logits: LogitsTile, num_rows: int, targets: torch.Tensor,
                            vocab_slice: Range, top_k: int = 0, tile_bytes: int = TILE_BYTES,
                            tp: comm.TensorGroup | None = None) -> LogprobRows:
    """log p(targets[i]) for rows 0..num_rows-1 of logits whose vocabulary is split over ranks.

    `local_logits(a, b, c, e)` returns rows a..b-1, local columns c..e-1 of this rank's logits
    (any float dtype, a fresh tensor: it is overwritten). `vocab_slice` is the [start, stop) of
    vocabulary ids this rank holds. Every rank must call this with the same rows, targets and
    top_k (the collectives pair up across ranks, over `tp`: None, a world of one); top-k comes
    back on rank 0 only.
    """
    tp = tp or comm.TensorGroup()
    start, stop = vocab_slice
    rows, cols = tile_shape(num_rows, stop - start, tile_bytes)
    out = LogprobRows(torch.empty(0))
    logprobs, top_ids, top_lps = [], [], []
    for a in range(0, num_rows, rows):
        b = min(num_rows, a + rows)
        lse, tgt, top = _local_pass(local_logits, a, b, cols, targets[a:b], vocab_slice, top_k,
                                    out)
        lse, tgt = _global_lse(lse, tgt, tp)
        logprobs.append(tgt - lse)
        if top_k:
            ids, lps = _merge_top_k(*top, top_k, tp)
            if ids is not None:
                top_ids.append(ids)
                top_lps.append(lps - lse.unsqueeze(-1))
    if logprobs:
        out.logprobs = torch.cat(logprobs)
    if top_ids:
        out.top_ids, out.top_logprobs = torch.cat(top_ids), torch.cat(top_lps)
    return out


def _local_pass(local_logits: LogitsTile, a: int, b: int, cols: int, targets: torch.Tensor,
                vocab_slice: Range, top_k: int, out: LogprobRows):
    """Rows a..b-1 over this rank's columns, a tile at a time: (log-sum-exp, target logit,
    top-k values and global ids), each merged across tiles as it goes."""
    start, stop = vocab_slice
    lse = tgt = top = None
    for c in range(0, stop - start, cols):
        e = min(stop - start, c + cols)
        tile = local_logits(a, b, c, e)
        half = 0 if tile.dtype == torch.float32 else tile.nbytes  # lives next to its copy
        tile = tile.float()
        # log_softmax is one fused pass (several times faster here than max, sub, exp, sum);
        # its output is a second tile, counted in the peak
        out.peak_logits_bytes = max(out.peak_logits_bytes, 2 * tile.nbytes + half)
        offset = targets.to(tile.device) - start - c
        mine = (offset >= 0) & (offset < e - c)
        picked = tile.gather(-1, (offset * mine).unsqueeze(-1)).squeeze(-1) * mine
        tgt = picked if tgt is None else tgt + picked
        if top_k:
            top = _running_top_k(top, tile, top_k, start + c)
        tile_lse = tile[:, 0] - torch.log_softmax(tile, dim=-1)[:, 0]
        lse = tile_lse if lse is None else torch.logaddexp(lse, tile_lse)
    if top is not None and top[0].shape[-1] < top_k:  # a slice narrower than k: pad it out
        pad = top_k - top[0].shape[-1]
        top = (torch.nn.functional.pad(top[0], (0, pad), value=float("-inf")),
               torch.nn.functional.pad(top[1], (0, pad), value=-1))
    return lse, tgt, top


def _running_top_k(top, tile: torch.Tensor, k: int, first_id: int):
    """The k best (logit, global id) per row over the columns seen so far and this tile."""
    values, ids = tile.topk(min(k, tile.shape[-1]), dim=-1)
    ids = ids + first_id
    if top is not None:
        values, ids = torch.cat([top[0], values], -1), torch.cat([top[1], ids], -1)
        values, where = values.topk(min(k, values.shape[-1]), dim=-1)
        ids = ids.gather(-1, where)
    return values, ids


def _global_lse(lse: torch.Tensor, tgt: torch.Tensor,
                tp: comm.TensorGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's log-sum-exp merged into the whole vocabulary's, and the target's logit from
    its owner (zero elsewhere, so a sum picks it): one all-reduce."""
    world, rank = tp.world_size(), tp.rank()
    # rows [0, W): each rank's log-sum-exp (its max + log of its sum of exps); W: target logit
    parts = torch.zeros(world + 1, len(lse), device=lse.device)
    parts[rank], parts[world] = lse, tgt
    tp.all_reduce(parts)
    return torch.logsumexp(parts[:world], dim=0), parts[world]


def _merge_top_k(values: torch.Tensor, ids: torch.Tensor, k: int, tp: comm.TensorGroup):
    """Rank 0 merges every rank's k best into the global k best (None, None elsewhere)."""
    world = tp.world_size()
    all_values = tp.gather_last_dim(values.contiguous(), [k] * world)
    all_ids = tp.gather_last_dim(ids.contiguous(), [k] * world)
    if all_values is None:
        return None, None
    best, where = all_values.topk(k, dim=-1)
    return all_ids.gather(-1, where), best
