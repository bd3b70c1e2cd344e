"""A sequence whose context sits in consecutive cache blocks is read as one slice of the cache
(no copy); any other is gathered block by block. Both give the attention of the formula."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.rank.attention import torch_attention
from engine.rank.kv_cache import KVCache
from engine.rank.step_context import BackendOps
from engine.rank.step_metadata import build_step_metadata, consecutive_from, first_of_run

BLOCK, HQ, HKV, D = 4, 4, 2, 8


@pytest.mark.parametrize("table,length,first", [
    ([3, 4, 5], 12, 3), ([3, 4, 5], 9, 3), ([3, 4, 9], 8, 3),  # blocks past the context: unread
    ([3, 4, 9], 9, None), ([5, 1, 3], 10, None), ([4, 3], 5, None), ([7], 1, 7),
    ([2, 3], 0, None), ([2], 5, None)])  # nothing to read; a table shorter than the context
def test_consecutive_from(table, length, first):
    assert consecutive_from(table, length, BLOCK) == first


def _attention_by_formula(q, keys, values, scale):
    """One decode query [hq, d] over keys/values [length, hkv, d], in float64."""
    out = []
    for h in range(HQ):
        kv = h // (HQ // HKV)
        weights = torch.softmax(keys[:, kv].double() @ q[h].double() * scale, dim=0)
        out.append(weights @ values[:, kv].double())
    return torch.stack(out)


def test_consecutive_blocks_are_read_in_place_and_attend_as_the_formula():
    gen = torch.Generator().manual_seed(0)
    cache = KVCache(2, 16, BLOCK, HKV, D, torch.float32, "cpu")
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))
    tables, lengths = [[6, 7, 8], [9, 2, 3], [11]], [11, 10, 3]  # consecutive, not, one block
    q = torch.randn(3, HQ, D, generator=gen)
    k_new, v_new = (torch.randn(3, HKV, D, generator=gen) for _ in range(2))
    heads = [h // (HQ // HKV) for h in range(HQ)]
    metas = {size: build_step_metadata([0, 1, 2, 3], lengths, tables, [0, 0, 0], heads, "cpu",
                                       uniform_groups=True, block_size=size)
             for size in (BLOCK, None)}
    assert metas[BLOCK].first_blocks == [6, None, 11] and metas[None].first_blocks is None
    keys, _ = cache.gather(1, tables[0], lengths[0], first_block=6)
    start = cache.data[0, 1, 6].data_ptr()
    assert keys.data_ptr() == start  # a view of the cache, not a copy
    outs = {size: torch_attention(1, q, k_new, v_new, cache, meta, 0.3)
            for size, meta in metas.items()}
    assert torch.equal(outs[BLOCK], outs[None])
    k_cache, v_cache = cache.layer(1)
    for i, (table, length) in enumerate(zip(tables, lengths)):
        keys = torch.cat([k_cache[b] for b in table])[:length]
        values = torch.cat([v_cache[b] for b in table])[:length]
        torch.testing.assert_close(outs[BLOCK][i].double(),
                                   _attention_by_formula(q[i], keys, values, 0.3),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("slots,first", [([8, 9, 10, 11, 12], 8), ([5], 5), ([0, 1, 2], 0),
                                         ([8, 9, 11], None), ([9, 8], None), ([3, 3], None),
                                         ([], None)])
def test_a_step_whose_slots_run_on_stores_them_as_one_slice(slots, first):
    """A step's new K/V whose slots run s, s + 1, ... (a prompt in fresh blocks, or its chunk
    after a cached prefix) are copied as one slice; any other run of slots is scattered. Both
    leave the cache as plain indexing writes it, every other slot untouched."""
    meta = build_step_metadata([0, len(slots)], [len(slots)], [[0, 1, 2, 3]], slots, [0, 0, 1, 1],
                               "cpu", block_size=BLOCK)
    assert meta.first_slot == first
    gen = torch.Generator().manual_seed(len(slots))
    cache = KVCache(2, 4, BLOCK, HKV, D, torch.float32, "cpu")
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))
    want = cache.data.clone()
    k, v = (torch.randn(len(slots), HKV, D, generator=gen) for _ in range(2))
    for row, slot in enumerate(slots):
        want[0, 1, slot // BLOCK, slot % BLOCK] = k[row]
        want[1, 1, slot // BLOCK, slot % BLOCK] = v[row]
    ctx = SimpleNamespace(cache=cache, meta=meta)
    BackendOps(KVCache.store, torch_attention).store(ctx, 1, k, v)
    assert torch.equal(cache.data, want)


def test_a_run_from_a_padding_slot_is_no_run():
    """-1 (a padding row's slot) starts no slice: one from -1 would wrap to the cache's end."""
    assert first_of_run([-1, 0, 1]) is None and first_of_run([0, 1]) == 0
