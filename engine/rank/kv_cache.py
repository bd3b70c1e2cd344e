"""This rank's paged KV cache: fixed-size blocks of slots, K and V for this rank's heads only."""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        self.block_size = block_size
        self.num_blocks = num_blocks
        # [k|v, layer, block, slot in block, kv head, head dim]
        self.data = torch.zeros(2, num_layers, num_blocks, block_size, kv_heads, head_dim,
                                dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * dtype.itemsize

    def release(self) -> None:
        """Give the cache's memory back now, not when the last reference to this object goes:
        torch 2.11's compiler kept the scope of a compiled call, a step context holding this
        cache among it, after the engine was gone (an H200's whole cache, in session 44)."""
        self.data = self.data.new_empty((2, self.data.shape[1], 0, *self.data.shape[3:]))
        self.num_blocks = 0

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        # select, not data[0, i]: in a compiled layer graph `i` is symbolic, and indexing
        # would specialise it (one graph per layer)
        k, v = self.data.select(1, i).unbind(0)
        return k, v

    def store(self, i: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Scatter the new tokens' K/V ([T, kv_heads, d]) into their slots."""
        store_into(self.data, i, k, v, slot_mapping)

    def store_run(self, i: int, k: torch.Tensor, v: torch.Tensor, first_slot: int) -> None:
        """`store` where the slots run first_slot, first_slot + 1, ...: one slice copy each for
        K and V, not a scatter (a 512-token prompt's layer of SmolLM2 stored in 12 against
        49 us on the AMX Xeon, a /tmp timing)."""
        k_cache, v_cache = self.layer(i)
        k_cache.flatten(0, 1)[first_slot:first_slot + len(k)].copy_(k)
        v_cache.flatten(0, 1)[first_slot:first_slot + len(v)].copy_(v)

    def gather(self, i: int, block_table: list[int] | torch.Tensor, length: int,
               first_block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first `length` positions of one sequence, [length, kv_heads, d]. The
        attention of every layer passes the step's device row of block ids (no host work).
        `first_block`: the table's blocks are known to run first_block, first_block + 1, ...
        (StepMetadata.first_blocks): K/V are then a view of the cache, no copy (a decode step
        of SmolLM2 at 256 tokens spent ~7 % of its time copying them)."""
        k_cache, v_cache = self.layer(i)
        used = -(-length // self.block_size)
        if first_block is not None:
            return (k_cache[first_block:first_block + used].flatten(0, 1)[:length],
                    v_cache[first_block:first_block + used].flatten(0, 1)[:length])
        blocks = block_table[:used]
        if not isinstance(blocks, torch.Tensor):
            blocks = torch.tensor(blocks, device=k_cache.device)
        # index_select: ~2x faster than k_cache[blocks] for the few blocks of a decode step
        k = k_cache.index_select(0, blocks).flatten(0, 1)[:length]
        v = v_cache.index_select(0, blocks).flatten(0, 1)[:length]
        return k, v


# Up to this many rows K and V are stacked and stored by one index_copy_: cheaper than two in
# a decode step, where every small op of every layer runs between weight reads that have
# emptied the caches. More rows store K and V apart: stacking them first is a copy more (a
# 512-token SmolLM2 layer: 50 against 83 us on the AVX512-BF16 EPYC, a /tmp timing)
STACKED_ROWS = 16


def store_into(data: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
               slot_mapping: torch.Tensor) -> None:
    """K/V [T, kv_heads, d] into their slots of `layer` in a cache's `data` ([k|v, layer,
    block, slot in block, kv head, head dim])."""
    slots = data.select(1, layer).view(2, -1, *k.shape[1:])
    index = slot_mapping.long()
    if len(k) <= STACKED_ROWS:
        slots.index_copy_(1, index, torch.stack((k, v)))
    else:
        slots[0].index_copy_(0, index, k)
        slots[1].index_copy_(0, index, v)
