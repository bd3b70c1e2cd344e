"""Tensor-parallel layers. Each owns the slice of its weight that this rank holds and reads
only that slice from the checkpoint, through a `TensorReader` that knows nothing of formats.

Collectives are modules of their own (`AllReduce`, `GatherToRankZero`), so anything observing
the model from outside (forward hooks) sees each one as a separate op.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from parallel import comm
from parallel.comm import TensorGroup
from parallel.partition import HeadPartition, Range, range_times

# (name, dim, start, stop) -> that slice of the named checkpoint tensor; dim None reads it whole.
# y = x Wᵀ (+ b): the product every projection runs, chosen by the engine per device
Matmul = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
TensorReader = Callable[[str, int | None, int, int], torch.Tensor]


def copy_checked(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"tensor {name!r}: checkpoint slice has shape {tuple(value.shape)}, "
                         f"this rank expects {tuple(param.shape)}")
    param.data.copy_(value)


def _frozen(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class AllReduce(nn.Module):
    """Sum over the group's ranks, in place; nothing to do for a world of one. With `async_op`
    the sum is started and a `comm.PendingAllReduce` returned, to `wait()` on after other work."""

    def __init__(self, tp: TensorGroup):
        super().__init__()
        self.tp = tp

    def forward(self, x: torch.Tensor,
                async_op: bool = False) -> torch.Tensor | comm.PendingAllReduce:
        if async_op:
            return self.tp.all_reduce_async(x)
        if torch.compiler.is_compiling():
            return self.tp.all_reduce_in_graph(x)
        return self.tp.all_reduce(x)


class GatherToRankZero(nn.Module):
    """Every rank's slice of the last dim, concatenated on rank 0 (None on the others)."""

    def __init__(self, sizes: Sequence[int], tp: TensorGroup):
        super().__init__()
        self.sizes, self.tp = list(sizes), tp

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.tp.gather_last_dim(x, self.sizes)


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ with W's output rows split over ranks; no communication.

    One layer may fuse several checkpoint tensors (gate+up, q+k+v): `out_slices[i]` is this
    rank's row range of the i-th tensor, and the local weight is their concatenation.
    """

    def __init__(self, in_features: int, out_slices: Sequence[Range], bias: bool = False,
                 matmul: Matmul = F.linear):
        super().__init__()
        self.matmul = matmul
        self.out_slices = list(out_slices)
        out = sum(b - a for a, b in self.out_slices)
        self.weight = _frozen(out, in_features)
        self.bias = _frozen(out) if bias else None

    def load(self, read: TensorReader, names: Sequence[str]) -> None:
        # kept: the reads the weight is made of (rows concatenated), so the engine can read
        # the same slices again in another form (its quantized weights)
        self.weight_reads = [(f"{n}.weight", 0, a, b) for n, (a, b) in zip(names, self.out_slices)]
        copy_checked(self.weight, torch.cat([read(*r) for r in self.weight_reads]),
                     f"{names[0]}.weight")
        if self.bias is not None:
            parts = [read(f"{n}.bias", 0, a, b) for n, (a, b) in zip(names, self.out_slices)]
            copy_checked(self.bias, torch.cat(parts), f"{names[0]}.bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection holding this rank's query heads and the KV heads they read."""

    def __init__(self, hidden: int, head_dim: int, heads: HeadPartition, bias: bool,
                 matmul: Matmul = F.linear):
        kv = range_times(heads.kv_heads, head_dim)
        super().__init__(hidden, [range_times(heads.q_heads, head_dim), kv, kv], bias, matmul)
        self.q_size = heads.num_q_heads * head_dim
        self.kv_size = heads.num_kv_heads * head_dim

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(nn.Module):
    """y = x Wᵀ with W's input columns split over ranks, then a sum over ranks (all-reduce)."""

    def __init__(self, in_slice: Range, out_features: int, tp: TensorGroup, bias: bool = False,
                 matmul: Matmul = F.linear):
        super().__init__()
        self.matmul = matmul
        self.in_slice = in_slice
        self.weight = _frozen(out_features, in_slice[1] - in_slice[0])
        self.bias = _frozen(out_features) if bias else None
        self.all_reduce = AllReduce(tp)

    def load(self, read: TensorReader, name: str) -> None:
        self.weight_reads = [(f"{name}.weight", 1, *self.in_slice)]  # as ColumnParallelLinear's
        copy_checked(self.weight, read(*self.weight_reads[0]), f"{name}.weight")
        if self.bias is not None:
            copy_checked(self.bias, read(f"{name}.bias", None, 0, 0), f"{name}.bias")

    def forward(self, x: torch.Tensor,
                async_op: bool = False) -> torch.Tensor | RowParallelInFlight:
        """`async_op`: the all-reduce started, not awaited; `.wait()` gives what the call
        would have (through the module call, so hooks such as the tracer see both ops)."""
        if async_op:
            return RowParallelInFlight(self.all_reduce(self.matmul(x, self.weight, None),
                                                       async_op=True),
                                       self.bias)
        y = self.all_reduce(self.matmul(x, self.weight, None))
        return y if self.bias is None else y + self.bias


class RowParallelInFlight:
    """A row-parallel linear whose sum over ranks is in flight."""

    def __init__(self, pending: comm.PendingAllReduce, bias: torch.Tensor | None):
        self.pending, self.bias = pending, bias

    def wait(self) -> torch.Tensor:
        y = self.pending.wait()
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each rank holds the rows of a slice of the vocabulary; ids outside it contribute zeros,
    and the all-reduce assembles every token's row."""

    def __init__(self, vocab_slice: Range, hidden: int, tp: TensorGroup):
        super().__init__()
        self.vocab_slice = vocab_slice
        self.weight = _frozen(vocab_slice[1] - vocab_slice[0], hidden)
        self.all_reduce = AllReduce(tp)

    def load(self, read: TensorReader, name: str) -> None:
        copy_checked(self.weight, read(f"{name}.weight", 0, *self.vocab_slice), f"{name}.weight")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.all_reduce.tp.world_size() == 1:
            return F.embedding(ids, self.weight)
        start, stop = self.vocab_slice
        inside = (ids >= start) & (ids < stop)
        rows = F.embedding((ids - start) * inside, self.weight) * inside.unsqueeze(-1)
        return self.all_reduce(rows)


class ParallelLMHead(nn.Module):
    """Logits for this rank's vocabulary slice, gathered to the full vocabulary on rank 0."""

    def __init__(self, vocab_ranges: Sequence[Range], rank: int, hidden: int, tp: TensorGroup,
                 tied_to: VocabParallelEmbedding | None = None, matmul: Matmul = F.linear):
        super().__init__()
        self.matmul = matmul
        self.vocab_ranges = list(vocab_ranges)
        self.vocab_slice = self.vocab_ranges[rank]
        self.tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight  # same rows, same memory
        else:
            self.weight = _frozen(self.vocab_slice[1] - self.vocab_slice[0], hidden)
        self.gather = GatherToRankZero([b - a for a, b in self.vocab_ranges], tp)

    def load(self, read: TensorReader, name: str) -> None:
        if not self.tied:
            copy_checked(self.weight, read(f"{name}.weight", 0, *self.vocab_slice), f"{name}.weight")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [n, d] for the positions that need logits only. Returns [n, vocab] on rank 0."""
        return self.gather(self.local(hidden))

    def local(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the logits [n, vocab slice], before the gather."""
        return self.matmul(hidden, self.weight, None)
