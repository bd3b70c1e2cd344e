"""The compiled decode graph's pieces, checked against plain formulas: its paged attention
(read through the block table, masked past each context), its padding of a step's rows, and
the custom op that stores K/V in place."""
from __future__ import annotations

import pytest
import torch

from engine.batch import Batch
from engine.rank import graph_ops
from engine.rank.kv_cache import KVCache
from engine.rank.padded_decode import PaddedDecode, pad_decode_step, padded_decode_attention

BLOCK, HKV, D = 4, 2, 8


def _reference(q: torch.Tensor, cache: KVCache, table: list[int], length: int,
               kv_head_of_q: list[int], scale: float) -> torch.Tensor:
    """One query row [hq, d] over the first `length` positions of a block list, in float64."""
    k_cache, v_cache = cache.layer(0)
    keys = torch.cat([k_cache[b] for b in table]).double()[:length]  # [length, hkv, d]
    values = torch.cat([v_cache[b] for b in table]).double()[:length]
    out = []
    for h, kv in enumerate(kv_head_of_q):
        weights = torch.softmax(keys[:, kv] @ q[h].double() * scale, dim=0)
        out.append(weights @ values[:, kv])
    return torch.stack(out)


@pytest.mark.parametrize("kv_head_of_q", [[0, 0, 1, 1], [0, 0, 1]])  # even and uneven groups
@pytest.mark.parametrize("compiled", [False, True])
def test_attention_matches_formula(kv_head_of_q, compiled):
    gen = torch.Generator().manual_seed(len(kv_head_of_q))
    cache = KVCache(1, 16, BLOCK, HKV, D, torch.float32, "cpu")
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))
    # blocks out of order and shared; contexts of 1, a whole number of blocks, and ragged
    tables, lengths = [[7, 2, 9], [3], [5, 11, 0, 4]], [10, 1, 16]
    width = 4
    meta = PaddedDecode(torch.zeros(3, dtype=torch.long),
                        torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                        torch.tensor(lengths), torch.tensor(kv_head_of_q))
    q = torch.randn(3, len(kv_head_of_q), D, generator=gen)
    fn = torch.compile(padded_decode_attention, dynamic=True) if compiled else padded_decode_attention
    got = fn(q, *cache.layer(0), meta, 0.3)
    for row, (table, length) in enumerate(zip(tables, lengths)):
        want = _reference(q[row], cache, table, length, kv_head_of_q, 0.3)
        torch.testing.assert_close(got[row].double(), want, atol=1e-5, rtol=1e-5)


def test_padding_repeats_the_last_row():
    """Padding rows write the very K/V of the step's last row into its own slot, so the store
    needs no scratch slot; the table is at least two blocks wide and masks past each context."""
    cache = KVCache(1, 16, BLOCK, HKV, D, torch.float32, "cpu")
    batch = Batch([11, 12, 13], [4, 0, 9], [0, 1, 2, 3], [5, 1, 10], [21, 40, 37],
                  [[5, 1], [10], [8, 3, 9]], [0, 1, 2])
    ctx = pad_decode_step(batch, cache, torch.tensor([0, 1]), 8)
    ids, positions, meta = ctx.token_ids, ctx.positions, ctx.meta
    assert ctx.graph == "decode-8" and ctx.cache is cache
    assert ids.tolist() == [11, 12, 13] + [13] * 5
    assert positions.tolist() == [4, 0, 9] + [9] * 5
    assert meta.slot_mapping.tolist() == [21, 40, 37] + [37] * 5
    assert meta.context_lens.tolist() == [5, 1, 10] + [10] * 5
    assert meta.block_table.tolist()[:3] == [[5, 1, 0], [10, 0, 0], [8, 3, 9]]
    one = Batch([1], [0], [0, 1], [1], [4], [[1]], [0])
    assert pad_decode_step(one, cache, torch.tensor([0, 1]), 1).meta.block_table.shape == (1, 2)


def test_store_op_writes_in_place():
    cache = KVCache(2, 4, BLOCK, HKV, D, torch.float32, "cpu")
    k, v = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    slots = torch.tensor([5, 14, 14])  # the last two rows: a padding row repeating the one before
    k[2], v[2] = k[1], v[1]
    graph_ops.kv_store(k, v, cache.data, 1, slots)
    keys, values = cache.gather(1, [1, 3], 8)  # positions 0-3 are slots 4-7, 4-7 are 12-15
    torch.testing.assert_close(keys[1], k[0])
    torch.testing.assert_close(values[6], v[1])
    assert cache.data[:, 0].abs().sum() == 0  # the other layer untouched
