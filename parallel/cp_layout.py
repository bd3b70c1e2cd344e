"""Which context rank owns which positions of a sequence, and where it keeps their K/V.

A prompt of P tokens is cut into 2·cp contiguous chunks (sizes differ by at most one); context
rank c takes chunk c and chunk 2·cp-1-c, one early and one late, so every rank has the same
amount of causal attention work (early queries see few keys, late ones many). Tokens generated
after the prompt go to the ranks in turn: position p to rank p % cp.

A rank keeps its positions' K/V compacted, in position order, in the first slots of the
sequence's own block table, and the driver gives a sequence only as many blocks as the rank
holding most of it needs (`max_held`): each rank's pool holds ~1/cp of every sequence. Pure
arithmetic, no torch: the driver (block counts) and the ranks (slots) share it.
"""
from __future__ import annotations

from parallel.partition import Range, even_ranges


def prompt_chunks(length: int, cp: int, c: int) -> list[Range]:
    """The two chunks of a `length`-token prompt that context rank c computes and keeps."""
    chunks = even_ranges(length, 2 * cp)
    return [chunks[c], chunks[2 * cp - 1 - c]]


def prompt_owner(position: int, length: int, cp: int) -> int:
    for c in range(cp):
        if any(a <= position < b for a, b in prompt_chunks(length, cp, c)):
            return c
    raise ValueError(f"position {position} is outside a prompt of {length} tokens")


def _turns_below(x: int, cp: int, c: int) -> int:
    """How many of positions [0, x) satisfy p % cp == c."""
    return max(0, (x - c + cp - 1) // cp)


def owner(position: int, prompt_len: int, cp: int) -> int:
    if position < prompt_len:
        return prompt_owner(position, prompt_len, cp)
    return position % cp


def local_count(length: int, prompt_len: int, cp: int, c: int) -> int:
    """How many of positions [0, length) rank c holds."""
    held = sum(max(0, min(b, length) - a) for a, b in prompt_chunks(prompt_len, cp, c))
    if length > prompt_len:
        held += _turns_below(length, cp, c) - _turns_below(prompt_len, cp, c)
    return held


def max_held(length: int, cp: int) -> int:
    """The most positions of a `length`-token sequence any context rank holds, whatever part of
    it was the prompt (a preempted sequence comes back as one longer prompt): of a P-token
    prompt at most ceil(P/cp) (the 2·cp chunks' extra tokens go to the first ones, so no rank
    gets two), of the positions dealt in turn after it at most ceil((length-P)/cp); together at
    most ceil(length/cp) + 1, a bound some lengths reach."""
    if cp == 1:
        return length
    return min(length, -(-length // cp) + 1)


def local_slot(index: int, block_table: list[int], block_size: int) -> int:
    """The cache slot of a rank's index-th kept position of a sequence."""
    return block_table[index // block_size] * block_size + index % block_size
