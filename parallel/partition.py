"""Which slice of each dimension every rank owns. Sizes need not divide the world size."""
from __future__ import annotations

from dataclasses import dataclass

Range = tuple[int, int]


def even_ranges(n: int, world_size: int) -> list[Range]:
    """Split range(n) into `world_size` contiguous parts whose sizes differ by at most one."""
    base, extra = divmod(n, world_size)
    ranges, start = [], 0
    for r in range(world_size):
        size = base + (1 if r < extra else 0)
        ranges.append((start, start + size))
        start += size
    return ranges


def range_times(r: Range, factor: int) -> Range:
    """[a, b) -> [a·factor, b·factor): heads to rows of their weights, KV groups to query heads."""
    return r[0] * factor, r[1] * factor


@dataclass(frozen=True, slots=True)
class HeadPartition:
    """The query heads and KV heads one rank holds, as global [start, stop) ranges."""

    q_heads: Range
    kv_heads: Range
    group_size: int  # query heads per KV head in the whole model

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    def kv_head_of_q_head(self) -> list[int]:
        """For each local query head, the index of the local KV head it reads."""
        return [h // self.group_size - self.kv_heads[0] for h in range(*self.q_heads)]


def partition_heads(num_heads: int, num_kv_heads: int, world_size: int) -> list[HeadPartition]:
    """Split attention heads over ranks.

    Up to the KV-head count, whole KV groups move together, so no KV head is stored twice
    (9 query / 3 KV heads at TP=2: 6+3 query heads, 2+1 KV heads). Beyond it, query heads are
    split as evenly as possible and each rank keeps every KV head its query heads read, so a KV
    head may be replicated on several ranks.
    """
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")
    if world_size > num_heads:
        raise ValueError(
            f"tensor parallel size {world_size} exceeds the {num_heads} attention heads; "
            f"use at most {num_heads} ranks")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if world_size <= num_kv_heads:
        kv = even_ranges(num_kv_heads, world_size)
        return [HeadPartition(range_times(r, group), r, group) for r in kv]
    parts = []
    for q0, q1 in even_ranges(num_heads, world_size):
        parts.append(HeadPartition((q0, q1), (q0 // group, (q1 - 1) // group + 1), group))
    return parts
