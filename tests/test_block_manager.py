"""Paged block allocation and the prefix cache, on real Sequence objects.

Expected block counts, cached-token counts and block ids are worked out by hand from the
block size and the documented free-list order (least recently freed first, a sequence's tail
block freed before its head).
"""
import pytest

from engine.driver.block_manager import BlockManager, chain_hash
from engine.driver.sampling_params import SamplingParams
from engine.driver.sequence import Sequence

BS = 4


def seq(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams())


def computed(bm: BlockManager, tokens) -> Sequence:
    """Allocate a prompt and mark all of it computed, as a finished prefill step would."""
    s = seq(tokens)
    assert bm.allocate(s)
    s.num_computed_tokens = s.num_tokens
    bm.register_computed(s)
    return s


def cache_prompt(bm: BlockManager, tokens) -> list[int]:
    """Run a prompt through the cache and release it; returns the block ids it used."""
    s = computed(bm, tokens)
    table = list(s.block_table)
    bm.free(s)
    return table


def check_ref_counts(bm: BlockManager, live: list[Sequence]) -> None:
    """Each block is referenced exactly as often as live block tables hold it, and the free list
    holds exactly the unreferenced blocks."""
    holders = [0] * bm.num_blocks
    for s in live:
        for bid in s.block_table:
            holders[bid] += 1
    assert [b.ref_count for b in bm.blocks] == holders
    assert set(bm.free_ids) == {i for i, n in enumerate(holders) if n == 0}


# ---------------------------------------------------------------- allocation


@pytest.mark.parametrize("n_tokens, n_blocks", [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3), (13, 4)])
def test_allocate_gives_ceil_n_over_block_size_blocks(n_tokens, n_blocks):
    bm = BlockManager(10, BS)
    s = seq(range(n_tokens))
    assert bm.allocate(s)
    assert len(s.block_table) == n_blocks
    assert len(set(s.block_table)) == n_blocks
    assert bm.num_free_blocks == 10 - n_blocks
    assert s.num_cached_tokens == 0 and s.num_computed_tokens == 0


def test_free_returns_blocks_and_accounting_adds_up():
    bm = BlockManager(10, BS)
    a, b = seq(range(9)), seq(range(100, 105))
    assert bm.allocate(a) and bm.allocate(b)
    assert bm.num_free_blocks == 10 - 3 - 2
    assert not set(a.block_table) & set(b.block_table)
    check_ref_counts(bm, [a, b])
    bm.free(a)
    assert bm.num_free_blocks == 10 - 2 and a.block_table == []
    check_ref_counts(bm, [b])
    bm.free(b)
    assert bm.num_free_blocks == 10
    check_ref_counts(bm, [])


def test_allocate_refuses_when_pool_too_small_and_changes_nothing():
    bm = BlockManager(2, BS)
    s = seq(range(9))  # needs 3 blocks
    assert not bm.allocate(s)
    assert s.block_table == [] and bm.num_free_blocks == 2
    check_ref_counts(bm, [])


# ---------------------------------------------------------------- prefix cache hits


def test_shared_full_blocks_are_served_from_cache():
    bm = BlockManager(16, BS)
    first = cache_prompt(bm, range(10))  # blocks [0..3], [4..7], partial [8, 9]
    s = seq(list(range(8)) + [100, 101, 102])  # shares exactly 2 full blocks
    assert bm.allocate(s)
    assert s.num_cached_tokens == 2 * BS
    assert s.num_computed_tokens == 2 * BS  # the cached K/V need no recompute
    assert s.block_table[:2] == first[:2]
    assert len(s.block_table) == 3 and s.block_table[2] not in first[:2]


def test_one_shared_block_gives_one_block_of_cached_tokens():
    bm = BlockManager(16, BS)
    first = cache_prompt(bm, range(12))
    s = seq([0, 1, 2, 3, 50, 51, 52, 53, 54])  # second block differs
    assert bm.allocate(s)
    assert s.num_cached_tokens == BS
    assert s.block_table[0] == first[0]


def test_fully_cached_prompt_still_computes_its_last_block():
    bm = BlockManager(16, BS)
    first = cache_prompt(bm, range(8))
    s = seq(range(8))  # both full blocks are cached
    assert bm.allocate(s)
    # the last token must run through the model to produce logits, so one block is recomputed
    assert s.num_cached_tokens == BS < s.num_tokens
    assert s.block_table[0] == first[0] and len(s.block_table) == 2


def test_prompt_differing_in_first_block_gets_nothing_cached():
    bm = BlockManager(16, BS)
    cache_prompt(bm, range(12))
    s = seq([99] + list(range(1, 12)))  # later blocks equal in content, but their prefix is not
    assert bm.allocate(s)
    assert s.num_cached_tokens == 0


def test_same_block_contents_at_another_position_is_not_a_hit():
    bm = BlockManager(16, BS)
    cache_prompt(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    s = seq([5, 6, 7, 8, 9, 9, 9, 9, 9])  # [5..8] was cached as block 1, not block 0
    assert bm.allocate(s)
    assert s.num_cached_tokens == 0


def test_same_block_contents_after_another_parent_is_not_a_hit():
    bm = BlockManager(16, BS)
    cache_prompt(bm, [1, 1, 1, 1, 5, 6, 7, 8, 9])
    other = cache_prompt(bm, [2, 2, 2, 2, 0, 0, 0, 0, 9])
    # block 0 matches the second prompt; block 1 [5..8] is cached, but only after parent [1,1,1,1]
    s = seq([2, 2, 2, 2, 5, 6, 7, 8, 9])
    assert bm.allocate(s)
    assert s.num_cached_tokens == BS
    assert s.block_table[0] == other[0]


def test_registering_in_chunks_chains_like_registering_at_once():
    bm = BlockManager(16, BS)
    s = seq(range(10))
    assert bm.allocate(s)
    s.num_computed_tokens = 6  # first chunk: only block 0 is full
    bm.register_computed(s)
    s.num_computed_tokens = 10  # second chunk completes block 1
    bm.register_computed(s)
    table = list(s.block_table)
    bm.free(s)
    t = seq(list(range(8)) + [77])
    assert bm.allocate(t)
    assert t.num_cached_tokens == 8 and t.block_table[:2] == table[:2]


def test_hit_statistics_count_lookup_and_hit_tokens():
    bm = BlockManager(16, BS)
    cache_prompt(bm, range(9))  # 9 looked up, 0 hit
    s = seq(range(9))  # 9 looked up, 8 hit
    assert bm.allocate(s)
    st = bm.stats()
    assert st["prefix_lookup_tokens"] == 18 and st["prefix_hit_tokens"] == 8
    assert st["hit_rate"] == pytest.approx(8 / 18)


def test_chain_hash_depends_on_parent_and_tokens():
    assert chain_hash(None, (1, 2)) == chain_hash(None, (1, 2))
    assert chain_hash(None, (1, 2)) != chain_hash(7, (1, 2))
    assert chain_hash(None, (1, 2)) != chain_hash(None, (2, 1))


# ---------------------------------------------------------------- hash collisions


def colliding(parent, tokens):
    return 42  # every block of every prompt gets the same key


def test_forced_collision_is_detected_and_not_served():
    bm = BlockManager(16, BS, hash_fn=colliding)
    cache_prompt(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    before = bm.collisions
    s = seq([10, 11, 12, 13, 14, 15, 16, 17, 18])
    assert bm.allocate(s)
    assert s.num_cached_tokens == 0  # key 42 is cached, but for other tokens
    assert bm.collisions > before


def test_forced_collision_still_serves_the_genuine_first_block():
    bm = BlockManager(16, BS, hash_fn=colliding)
    first = cache_prompt(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    s = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.allocate(s)
    # block 0 is the one key 42 points to; block 1's lookup lands on block 0 again, whose tokens
    # differ, so the walk stops after one block
    assert s.num_cached_tokens == BS
    assert s.block_table[0] == first[0]


def test_forced_collision_never_serves_a_block_at_a_second_position():
    # Prompt A = [7,7,7,7, 1,2,3,4, 5] is cached; key 42 -> A's block 0 (tokens 7,7,7,7).
    # Prompt B = [7,7,7,7, 7,7,7,7, 5]: its block 0 genuinely equals A's block 0 (same tokens,
    # same empty prefix), so 4 tokens may be served. Its block 1 has the same *tokens* as A's
    # block 0 but sits at positions 4..7 after a different prefix: A's K/V for positions 0..3
    # are not B's K/V for positions 4..7, so by hand exactly 4 tokens are cacheable and no
    # block may appear twice in one block table.
    bm = BlockManager(16, BS, hash_fn=colliding)
    first = cache_prompt(bm, [7, 7, 7, 7, 1, 2, 3, 4, 5])
    s = seq([7, 7, 7, 7, 7, 7, 7, 7, 5])
    assert bm.allocate(s)
    assert s.block_table[0] == first[0]
    assert len(set(s.block_table)) == len(s.block_table), s.block_table
    assert s.num_cached_tokens == BS


# ---------------------------------------------------------------- eviction


def test_least_recently_freed_cached_block_is_evicted_first():
    bm = BlockManager(6, BS)
    a = computed(bm, [1, 2, 3, 4])  # block 0
    b = computed(bm, [5, 6, 7, 8])  # block 1
    assert (a.block_table, b.block_table) == ([0], [1])
    bm.free(b)  # b's block is now the least recently freed cached block
    bm.free(a)
    # free order by hand: never-used 2, 3, 4, 5, then b's block 1, then a's block 0
    filler = seq(range(100, 116))  # 4 blocks: takes 2, 3, 4, 5
    assert bm.allocate(filler) and filler.block_table == [2, 3, 4, 5]
    v = seq([200])
    assert bm.allocate(v) and v.block_table == [1]  # evicts b, keeps a
    assert len(bm.cached) == 1  # only a's block is still keyed; b's key went with its block
    bm.free(filler)
    bm.free(v)
    # a's prefix is still served, b's evicted prefix is not
    a2, b2 = seq([1, 2, 3, 4, 9]), seq([5, 6, 7, 8, 9])
    assert bm.allocate(a2) and a2.num_cached_tokens == BS and a2.block_table[0] == 0
    assert bm.allocate(b2) and b2.num_cached_tokens == 0
    assert bm.collisions == 0  # a plain miss, not a stale key pointing at reused contents


def test_tail_block_is_evicted_before_head_block():
    bm = BlockManager(3, BS)
    first = cache_prompt(bm, range(8))  # blocks 0, 1; freed tail first: free order 2, 1, 0
    assert first == [0, 1]
    x = seq(range(100, 108))  # takes 2 and 1 (the tail of the cached prompt), in ascending order
    assert bm.allocate(x) and x.block_table == [1, 2]
    bm.free(x)
    s = seq(list(range(8)) + [9])
    assert bm.allocate(s)
    assert s.num_cached_tokens == BS  # the head survives, the evicted tail no longer hits
    assert s.block_table[0] == 0


def test_blocks_of_a_running_sequence_are_never_handed_out():
    bm = BlockManager(4, BS)
    running = computed(bm, range(8))  # holds 2 blocks, cached but still referenced
    others = [seq([50 + i]) for i in range(2)]
    for o in others:
        assert bm.allocate(o)
        assert not set(o.block_table) & set(running.block_table)
    late = seq([99])
    assert not bm.allocate(late)  # the pool is empty: cached blocks in use must not be evicted
    check_ref_counts(bm, [running, *others])
    # and the running sequence's blocks still serve hits
    assert bm.cached and all(bm.blocks[b].ref_count == 1 for b in running.block_table)


# ---------------------------------------------------------------- sharing and ref counts


def test_live_sequences_share_a_cached_prefix_by_ref_count():
    bm = BlockManager(8, BS)
    a = computed(bm, range(9))  # still running
    b = seq(list(range(4)) + [70, 71])
    free_before = bm.num_free_blocks
    assert bm.allocate(b)
    shared = a.block_table[0]
    assert b.block_table[0] == shared and b.num_cached_tokens == BS
    assert bm.blocks[shared].ref_count == 2
    assert bm.num_free_blocks == free_before - 1  # only b's second block is new
    check_ref_counts(bm, [a, b])
    bm.free(a)
    assert bm.blocks[shared].ref_count == 1
    assert shared not in bm.free_ids  # b still reads it
    check_ref_counts(bm, [b])
    bm.free(b)
    assert shared in bm.free_ids
    check_ref_counts(bm, [])


def test_reviving_a_freed_cached_block_takes_it_off_the_free_list():
    bm = BlockManager(4, BS)
    first = cache_prompt(bm, range(8))
    assert bm.num_free_blocks == 4
    s = seq(list(range(4)) + [9])
    assert bm.allocate(s)
    assert s.block_table[0] == first[0]
    assert bm.num_free_blocks == 2  # one revived, one fresh
    check_ref_counts(bm, [s])


def test_revived_blocks_count_against_free_space():
    # 3 free blocks, all cached by the first prompt; the new prompt revives 2 and needs 2 fresh:
    # only 1 would be left after reviving, so it must be refused
    bm = BlockManager(3, BS)
    cache_prompt(bm, range(12))
    s = seq(list(range(8)) + list(range(100, 108)))
    assert not bm.allocate(s)
    assert bm.num_free_blocks == 3 and s.block_table == []
    check_ref_counts(bm, [])


# ---------------------------------------------------------------- growth


def test_ensure_capacity_adds_a_block_only_when_needed():
    bm = BlockManager(4, BS)
    s = seq(range(4))
    assert bm.allocate(s) and len(s.block_table) == 1
    assert bm.ensure_capacity(s) and len(s.block_table) == 1  # 4 tokens fit one block
    s.token_ids.append(10)  # 5th token: needs a second block
    assert bm.ensure_capacity(s) and len(s.block_table) == 2
    assert bm.num_free_blocks == 2
    for t in range(11, 14):  # tokens 6..8 still fit the second block
        s.token_ids.append(t)
        assert bm.ensure_capacity(s) and len(s.block_table) == 2
    check_ref_counts(bm, [s])


def test_ensure_capacity_fails_on_an_empty_pool():
    bm = BlockManager(1, BS)
    s = seq(range(4))
    assert bm.allocate(s)
    s.token_ids.append(4)
    assert not bm.ensure_capacity(s)
    assert len(s.block_table) == 1
    check_ref_counts(bm, [s])


# ---------------------------------------------------------------- caching off


def test_prefix_caching_off_never_reports_cached_tokens():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    cache_prompt(bm, range(12))
    s = seq(range(12))
    assert bm.allocate(s)
    assert s.num_cached_tokens == 0 and s.num_computed_tokens == 0
    assert len(s.block_table) == 3
    assert bm.cached == {} and bm.stats()["prefix_hit_tokens"] == 0


def test_a_context_stays_in_consecutive_blocks_where_it_can():
    """A new sequence takes a run of free blocks that cache nothing, found from the least
    recently freed ones, in ascending order, and grows into the block after its last when that one is free and caches nothing,
    so its context is one run of blocks (StepMetadata.first_blocks). Where no run is free it
    takes the least recently freed blocks, in ascending order."""
    bm = BlockManager(12, BS, enable_prefix_caching=False)
    a, b, c = seq(range(3 * BS)), seq(range(2 * BS)), seq(range(3 * BS))
    for s in (a, b, c):
        assert bm.allocate(s)
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1, 2], [3, 4], [5, 6, 7])
    bm.free(a)
    bm.free(c)  # free: 8-11, then 2, 1, 0, then 7, 6, 5
    again = seq(range(4 * BS))
    assert bm.allocate(again) and again.block_table == [5, 6, 7, 8]  # the first free run
    again.token_ids.append(7)  # past its blocks: the next one, 9, is free and empty
    assert bm.ensure_capacity(again) and again.block_table == [5, 6, 7, 8, 9]
    bm.free(b)  # free: 10, 11, 2, 1, 0, 4, 3
    run = seq(range(5 * BS))
    assert bm.allocate(run) and run.block_table == [0, 1, 2, 3, 4]
    grown = seq(range(BS))
    assert bm.allocate(grown) and grown.block_table == [10]
    grown.token_ids.append(7)
    assert bm.ensure_capacity(grown) and grown.block_table == [10, 11]
    check_ref_counts(bm, [again, run, grown])


def test_without_a_free_run_the_least_recently_freed_blocks_are_taken_in_order():
    bm = BlockManager(6, BS, enable_prefix_caching=False)
    held = [seq(range(BS)) for _ in range(6)]
    for s in held:
        assert bm.allocate(s)
    for i in (4, 0, 2):  # free: 4, 0, 2, none next to another
        bm.free(held[i])
    two = seq(range(2 * BS))
    assert bm.allocate(two) and two.block_table == [0, 4]
    assert list(bm.free_ids) == [2]


def test_growing_into_the_next_block_never_evicts_a_cached_prefix():
    bm = BlockManager(4, BS)
    grower = seq(range(200, 200 + BS))
    assert bm.allocate(grower) and grower.block_table == [0]
    assert cache_prompt(bm, range(BS)) == [1]  # block 1 caches a prefix, free again
    grower.token_ids.append(7)
    assert bm.ensure_capacity(grower) and grower.block_table == [0, 2]  # not 1: it caches
    assert bm.cached_prefix_tokens(list(range(BS)) + [5]) == BS
