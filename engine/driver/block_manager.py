"""Paged KV blocks on the driver, and the prefix cache over them.

Every full block is keyed by a chained hash of its tokens and of the block before it, so a key
names a whole prefix. A hit is served only after its tokens and its parent's key are compared,
so a hash collision can never hand out another prompt's K/V. Blocks nobody references stay cached until the pool
needs them, least recently freed first.
"""
from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable

from engine.driver.sequence import Sequence
from parallel.cp_layout import max_held

HashFn = Callable[[int | None, tuple[int, ...]], int]

# how many of the least recently freed blocks a new sequence tries to start a run of
# consecutive blocks at, before it takes them as they come (a bounded cost per allocation)
RUN_TRIES = 8


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """A 64-bit key of (parent key, tokens). Python's own tuple hash is cheap to collide on
    purpose; a keyed digest is not, and the token/parent check backs it up anyway."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent or 0).to_bytes(8, "little", signed=False))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()

    def holds(self, parent: int | None, tokens: tuple[int, ...]) -> bool:
        """Whether this block really is `tokens` following the prefix named by `parent`."""
        return self.hash is not None and self.parent_hash == parent and self.token_ids == tokens


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: HashFn = chain_hash, cp: int = 1):
        self.block_size = block_size
        self.cp = cp  # context ranks: each keeps only its positions, compacted (cp_layout)
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # chained hash -> block id
        self.pins: Counter[int] = Counter()  # block id -> exported handles holding it
        self.lookup_tokens = 0
        self.hit_tokens = 0
        self.collisions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, num_tokens: int) -> int:
        """The blocks a sequence of `num_tokens` holds: with cp > 1 only as many as the context
        rank keeping most of its positions fills (every rank indexes the same table)."""
        return self.blocks_for(max_held(num_tokens, self.cp))

    def _cached_prefix(self, tokens: list[int]) -> list[int]:
        hits, parent = [], None
        for b in range(len(tokens) // self.block_size):
            chunk = tuple(tokens[b * self.block_size:(b + 1) * self.block_size])
            h = self.hash_fn(parent, chunk)
            bid = self.cached.get(h)
            if bid is None:
                break
            if not self.blocks[bid].holds(parent, chunk):
                self.collisions += 1
                break
            hits.append(bid)
            parent = h
        if hits and len(hits) * self.block_size == len(tokens):
            hits.pop()  # the last token must run through the model to give logits
        return hits

    def cached_prefix_tokens(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` a request would find cached here (for routing)."""
        return len(self._cached_prefix(tokens)) * self.block_size if self.enable_prefix_caching else 0

    def allocate(self, seq: Sequence, use_prefix_cache: bool = True) -> bool:
        """Give a waiting sequence blocks for all its tokens, reusing cached ones (unless told
        not to). False if the pool cannot hold it now."""
        use = self.enable_prefix_caching and use_prefix_cache
        hits = self._cached_prefix(seq.token_ids) if use else []
        fresh = self.blocks_needed(seq.num_tokens) - len(hits)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if self.num_free_blocks - revived < fresh:
            return False
        for bid in hits:
            self._take(bid)
        seq.block_table = hits + self._take_fresh_run(fresh)
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)
        seq.parent_hash = self.blocks[hits[-1]].hash if hits else None
        self.lookup_tokens += seq.num_tokens
        self.hit_tokens += seq.num_cached_tokens
        return True

    def ensure_capacity(self, seq: Sequence) -> bool:
        """Add a block when the sequence's tokens outgrow its table. False if none is free."""
        if self.blocks_needed(seq.num_tokens) <= len(seq.block_table):
            return True
        if not self.free_ids:
            return False
        following = seq.block_table[-1] + 1 if seq.block_table else None
        if following in self.free_ids and self.blocks[following].hash is None:
            # free and caching nothing: the context stays consecutive
            seq.block_table.append(self._claim(following))
        else:
            seq.block_table.append(self._take_fresh())
        return True

    def register_computed(self, seq: Sequence) -> None:
        """Enter the sequence's newly completed blocks into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        for b in range(seq.num_hashed_blocks, full):
            chunk = tuple(seq.token_ids[b * self.block_size:(b + 1) * self.block_size])
            h = self.hash_fn(seq.parent_hash, chunk)
            block = self.blocks[seq.block_table[b]]
            block.hash, block.parent_hash, block.token_ids = h, seq.parent_hash, chunk
            self.cached.setdefault(h, block.block_id)
            seq.parent_hash = h
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def free(self, seq: Sequence) -> None:
        # tail first, so a prompt's leading blocks are the last to be evicted
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_ids[bid] = None
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.parent_hash = None

    def allocate_blocks(self, n: int) -> list[int] | None:
        """`n` fresh blocks for K/V written from outside (a KV hand-off); None if too few are free."""
        if self.num_free_blocks < n:
            return None
        return self._take_fresh_run(n)

    def free_blocks(self, block_table: list[int]) -> None:
        """Drop one reference to each block (an exported or adopted table without a sequence)."""
        for bid in reversed(block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_ids[bid] = None

    def can_pin(self, block_table: list[int], keep_free: int) -> bool:
        """Whether pinning `block_table` as well leaves `keep_free` blocks no export holds."""
        return self.num_blocks - len(self.pins.keys() | set(block_table)) >= keep_free

    def pin(self, block_table: list[int]) -> None:
        """An export takes over a finished sequence's references to these blocks."""
        self.pins.update(block_table)

    def unpin(self, block_table: list[int]) -> None:
        """An export ended (decoded, released, expired): its references go back."""
        self.pins.subtract(block_table)
        for bid in block_table:
            if self.pins[bid] <= 0:
                del self.pins[bid]
        self.free_blocks(block_table)

    def _take(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self.free_ids[bid]
        block.ref_count += 1

    def _take_fresh_run(self, n: int) -> list[int]:
        """`n` fresh blocks in ascending order: one run of consecutive free blocks that cache
        nothing when one holds one of the RUN_TRIES least recently freed blocks, else the
        least recently freed blocks. A context in consecutive blocks is read as one view of
        the cache, where scattered blocks are copied at every layer of every decode step
        (KVCache.gather); a sequence freed tail first leaves its blocks in descending order."""
        for bid in list(itertools.islice(self.free_ids, RUN_TRIES)):
            start = self._run_start(bid, n)
            if start is not None:
                return [self._claim(b) for b in range(start, start + n)]
        return sorted(self._take_fresh() for _ in range(n))

    def _run_start(self, bid: int, n: int) -> int | None:
        """The first of n consecutive free, empty blocks that include `bid` (the lowest such
        start), or None. At most 2n lookups."""
        def empty(b: int) -> bool:
            return b in self.free_ids and self.blocks[b].hash is None

        if not empty(bid):
            return None
        low = high = bid
        while low > bid - n + 1 and empty(low - 1):
            low -= 1
        while high < low + n - 1 and empty(high + 1):
            high += 1
        return low if high - low + 1 == n else None

    def _take_fresh(self) -> int:
        """The least recently freed block."""
        return self._claim(next(iter(self.free_ids)))

    def _claim(self, bid: int) -> int:
        """Free block `bid` for new K/V: out of the pool, its cached prefix (if any) forgotten."""
        del self.free_ids[bid]
        block = self.blocks[bid]
        if block.hash is not None and self.cached.get(block.hash) == bid:
            del self.cached[block.hash]  # evicted: its contents are about to be overwritten
        block.hash, block.parent_hash, block.token_ids, block.ref_count = None, None, (), 1
        return bid

    def stats(self) -> dict:
        return {"blocks_total": self.num_blocks, "blocks_free": self.num_free_blocks,
                "blocks_used": self.num_blocks - self.num_free_blocks,
                "blocks_pinned": len(self.pins), "cached_blocks": len(self.cached),
                "prefix_lookup_tokens": self.lookup_tokens,
                "prefix_hit_tokens": self.hit_tokens, "hash_collisions": self.collisions,
                "hit_rate": self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0}
