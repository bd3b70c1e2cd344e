"""The process sub-groups of a replica that splits by context (cp) and by tensor (tp), and the
row collectives context parallelism needs.

Global rank r is context rank r // tp and tensor rank r % tp: a tensor-parallel group is tp
consecutive ranks (packed together, they all-reduce every layer), a context-parallel group is the
cp ranks holding the same heads (they exchange K/V and attention partials).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel import comm


@dataclass(frozen=True, slots=True)
class Groups:
    tp: int
    cp: int
    tp_rank: int
    cp_rank: int
    tensor: comm.TensorGroup  # the layers' collectives, over this rank's TP sub-group
    cp_group: object  # dist ProcessGroup

    @property
    def clock(self) -> comm.CollectiveClock:
        """The rank's one collective clock (its tensor group's), which CP collectives add to."""
        return self.tensor.clock


def rank_layout(rank: int, tp: int) -> tuple[int, int]:
    """(context rank, tensor rank) of global rank `rank`."""
    return rank // tp, rank % tp


def make_groups(tp: int, cp: int) -> Groups:
    """Every rank creates every sub-group (torch.distributed requires all ranks to take part in
    each new_group, in the same order), then keeps its own two; the layers' collectives run
    over the tensor-parallel one (`Groups.tensor`)."""
    me = dist.get_rank()
    if dist.get_world_size() != tp * cp:
        raise ValueError(f"a group of {dist.get_world_size()} ranks cannot be tp={tp} x cp={cp}")
    tp_groups = [dist.new_group([c * tp + t for t in range(tp)]) for c in range(cp)]
    cp_groups = [dist.new_group([c * tp + t for c in range(cp)]) for t in range(tp)]
    cp_rank, tp_rank = rank_layout(me, tp)
    return Groups(tp, cp, tp_rank, cp_rank, comm.TensorGroup(tp_groups[cp_rank]),
                  cp_groups[tp_rank])


def all_gather_rows(x: torch.Tensor, counts: list[int], group,
                    clock: comm.CollectiveClock) -> list[torch.Tensor]:
    """Every context rank's rows of `x` (rank r holds counts[r] rows; this rank's x has its
    own count), padded to the largest for the collective and trimmed after."""
    width = max(counts)
    padded = torch.zeros((width, *x.shape[1:]), dtype=x.dtype, device=x.device)
    padded[:len(x)] = x
    parts = [torch.empty_like(padded) for _ in counts]
    start = time.perf_counter()
    dist.all_gather(parts, padded, group=group)
    clock.add_since(start)
    return [p[:n] for p, n in zip(parts, counts)]


def gather_rows_to_first(x: torch.Tensor, counts: list[int], group,
                         clock: comm.CollectiveClock) -> list[torch.Tensor] | None:
    """Every context rank's rows on the group's first rank (None on the others)."""
    width = max(counts)
    padded = torch.zeros((width, *x.shape[1:]), dtype=x.dtype, device=x.device)
    padded[:len(x)] = x
    first = dist.get_rank(group) == 0
    parts = [torch.empty_like(padded) for _ in counts] if first else None
    start = time.perf_counter()
    dist.gather(padded, parts, group=group, group_dst=0)
    clock.add_since(start)
    return [p[:n] for p, n in zip(parts, counts)] if first else None
