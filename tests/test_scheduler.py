"""The scheduler driven by hand, with a real BlockManager and no model: schedule, build the
batch, and feed back one fake sampled id per logits row. Expected batches are written out by hand.
"""
import itertools

from engine.driver.block_manager import BlockManager
from engine.driver.sampling_params import SamplingParams
from engine.driver.scheduler import Scheduler
from engine.driver.sequence import Sequence, Status

BS = 4
EOS = 2


def make(num_blocks=32, budget=64, max_num_seqs=8, max_model_len=1000, caching=True):
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
    return Scheduler(bm, budget, max_num_seqs, max_model_len, [EOS]), bm


def seq(tokens, **params) -> Sequence:
    return Sequence(list(tokens), SamplingParams(**params))


def step(sched, token_ids=None):
    """One engine step; every sampled row gets token 1000 + row unless token_ids says otherwise."""
    scheduled = sched.schedule()
    batch = sched.build_batch(scheduled)
    if token_ids is None:
        token_ids = [1000 + i for i in range(len(batch.logits_indices))]
    finished = sched.postprocess(scheduled, token_ids)
    return scheduled, batch, finished


def check_blocks(sched, bm):
    """No block is owned twice: each block's ref count equals the number of running block tables
    holding it (shared prefix blocks count once per table), and free blocks are unreferenced."""
    holders = [0] * bm.num_blocks
    for s in sched.running:
        for bid in s.block_table:
            holders[bid] += 1
    for s in sched.waiting:
        assert s.block_table == []  # waiting (also preempted) sequences hold nothing
    assert [b.ref_count for b in bm.blocks] == holders
    assert set(bm.free_ids) == {i for i, n in enumerate(holders) if n == 0}


# ---------------------------------------------------------------- the flat batch


def test_build_batch_for_two_prompts_by_hand():
    sched, _ = make()
    a, b = seq([11, 12, 13, 14, 15]), seq([21, 22, 23])
    sched.add(a)
    sched.add(b)
    scheduled = sched.schedule()
    assert scheduled == [(a, 5), (b, 3)]
    batch = sched.build_batch(scheduled)
    a0, a1 = a.block_table  # 5 tokens -> 2 blocks
    (b0,) = b.block_table  # 3 tokens -> 1 block
    assert batch.token_ids == [11, 12, 13, 14, 15, 21, 22, 23]
    assert batch.positions == [0, 1, 2, 3, 4, 0, 1, 2]
    assert batch.cu_seqlens_q == [0, 5, 8]
    assert batch.context_lens == [5, 3]
    assert batch.slot_mapping == [a0 * 4 + 0, a0 * 4 + 1, a0 * 4 + 2, a0 * 4 + 3, a1 * 4 + 0,
                                  b0 * 4 + 0, b0 * 4 + 1, b0 * 4 + 2]
    assert batch.block_tables == [[a0, a1], [b0]]
    assert batch.logits_indices == [4, 7]  # last row of each sequence
    assert [s.step for s in batch.sampling] == [0, 0]
    assert batch.num_tokens == 8 and batch.num_seqs == 2


def test_sampled_ids_go_to_their_sequences_and_decode_batch_follows():
    sched, _ = make()
    a, b = seq([11, 12, 13, 14, 15]), seq([21, 22, 23])
    sched.add(a)
    sched.add(b)
    step(sched, token_ids=[100, 200])
    assert a.output_token_ids == [100] and b.output_token_ids == [200]
    _, batch, _ = step(sched, token_ids=[101, 201])
    a0, a1 = a.block_table
    (b0,) = b.block_table
    # decode: each sequence runs only its last sampled token, at the next position
    assert batch.token_ids == [100, 200]
    assert batch.positions == [5, 3]
    assert batch.cu_seqlens_q == [0, 1, 2]
    assert batch.context_lens == [6, 4]
    assert batch.slot_mapping == [a1 * 4 + 1, b0 * 4 + 3]
    assert batch.logits_indices == [0, 1]
    assert [s.step for s in batch.sampling] == [1, 1]  # one token sampled before
    assert a.output_token_ids == [100, 101] and b.output_token_ids == [200, 201]


def test_prefix_cached_tokens_are_not_scheduled_again():
    sched, _ = make()
    first = seq(range(10), max_tokens=1)
    sched.add(first)
    step(sched)
    assert first.finish_reason == "length"
    second = seq(list(range(8)) + [50, 51, 52])  # shares 2 full blocks with the first
    sched.add(second)
    scheduled, batch, _ = step(sched)
    assert scheduled == [(second, 3)]
    assert batch.token_ids == [50, 51, 52] and batch.positions == [8, 9, 10]
    assert batch.context_lens == [11]


# ---------------------------------------------------------------- chunked prefill


def test_long_prompt_is_chunked_under_the_token_budget():
    sched, _ = make(budget=4)
    s = seq(range(100, 110))
    sched.add(s)
    chunks = []
    for _ in range(3):
        scheduled, batch, _ = step(sched, token_ids=None)
        chunks.append((scheduled[0][1], batch.positions, batch.context_lens, batch.logits_indices))
    assert chunks == [
        (4, [0, 1, 2, 3], [4], []),  # no logits until the prompt is complete
        (4, [4, 5, 6, 7], [8], []),
        (2, [8, 9], [10], [1]),  # last chunk: its last row is sampled
    ]
    assert s.num_computed_tokens == 10 and s.output_token_ids == [1000]


def test_chunks_carry_the_right_tokens_and_slots():
    sched, _ = make(budget=4)
    s = seq(range(100, 110))
    sched.add(s)
    _, b1, _ = step(sched)
    _, b2, _ = step(sched)
    _, b3, _ = step(sched)
    t0, t1, t2 = s.block_table
    assert b1.token_ids + b2.token_ids + b3.token_ids == list(range(100, 110))
    assert b2.slot_mapping == [t1 * 4 + 0, t1 * 4 + 1, t1 * 4 + 2, t1 * 4 + 3]
    assert b3.slot_mapping == [t2 * 4 + 0, t2 * 4 + 1]


# ---------------------------------------------------------------- decode first


def test_decode_is_scheduled_before_a_waiting_prompt_takes_the_rest():
    sched, _ = make(budget=4)
    d = seq([1, 3, 5])
    sched.add(d)
    step(sched)  # d's prompt done: it now has one pending token
    assert d.num_pending_tokens == 1
    long = seq(range(10, 30))
    sched.add(long)
    scheduled, batch, _ = step(sched)
    assert scheduled == [(d, 1), (long, 3)]  # decode 1 token, prompt gets 4 - 1
    assert batch.token_ids[0] == 1000  # d's sampled token runs first


def test_running_decode_not_starved_by_a_running_chunked_prompt():
    sched, _ = make(budget=4)
    d = seq([1, 3])
    long = seq(range(10, 30))
    sched.add(d)
    sched.add(long)
    step(sched)  # d: 2 tokens, long: first 2 tokens
    for _ in range(3):
        scheduled, _, _ = step(sched)
        # every step the decode takes 1 token, the chunked prompt the other 3
        assert scheduled == [(d, 1), (long, 3)]


def test_decodes_go_first_whatever_the_running_order():
    # Admission alone never puts a decode behind a half-done prompt in `running`, so the order is
    # reversed by hand to check the policy itself: the prompt, listed first, must not eat the
    # whole budget and starve the decode.
    sched, _ = make(budget=4)
    d, long = seq([1, 3]), seq(range(10, 30))
    sched.add(d)
    sched.add(long)
    step(sched)
    sched.running.reverse()
    assert sched.running == [long, d]
    scheduled, batch, _ = step(sched)
    assert scheduled == [(d, 1), (long, 3)]
    assert batch.logits_indices == [0]  # only the decode samples


# ---------------------------------------------------------------- stopping


def test_eos_stops_with_reason_stop_and_frees_blocks():
    sched, bm = make(num_blocks=8)
    s = seq([5, 6, 7, 8, 9], max_tokens=10)
    sched.add(s)
    step(sched, token_ids=[50])
    _, _, finished = step(sched, token_ids=[EOS])
    assert finished == [s]
    assert s.finish_reason == "stop" and s.status is Status.FINISHED
    assert s.output_token_ids == [50, EOS]
    assert s.block_table == [] and len(s.kv_block_table) == 2
    assert bm.num_free_blocks == 8 and not sched.has_work()


def test_ignore_eos_runs_to_max_tokens():
    sched, _ = make()
    s = seq([5, 6, 7], max_tokens=3, ignore_eos=True)
    sched.add(s)
    assert step(sched, token_ids=[EOS])[2] == []
    assert step(sched, token_ids=[EOS])[2] == []
    assert step(sched, token_ids=[EOS])[2] == [s]
    assert s.finish_reason == "length" and s.output_token_ids == [EOS, EOS, EOS]


def test_max_tokens_stops_with_reason_length():
    sched, bm = make(num_blocks=8)
    s = seq([5, 6, 7], max_tokens=2)
    sched.add(s)
    assert step(sched)[2] == []
    assert step(sched)[2] == [s]
    assert s.finish_reason == "length" and len(s.output_token_ids) == 2
    assert bm.num_free_blocks == 8


def test_max_model_len_stops_with_reason_length():
    sched, _ = make(max_model_len=7)
    s = seq([5, 6, 7, 8, 9], max_tokens=100)
    sched.add(s)
    assert step(sched)[2] == []  # 6 tokens
    assert step(sched)[2] == [s]  # 7 tokens == max_model_len
    assert s.finish_reason == "length" and s.num_tokens == 7


def test_finished_sequence_leaves_the_others_running():
    sched, bm = make()
    a, b = seq([5, 6, 7], max_tokens=5), seq([8, 9], max_tokens=5)
    sched.add(a)
    sched.add(b)
    _, _, finished = step(sched, token_ids=[EOS, 60])
    assert finished == [a] and sched.running == [b]
    check_blocks(sched, bm)


# ---------------------------------------------------------------- preemption


def run_to_completion(sched, bm, max_steps=100):
    """Step until idle, checking block ownership after every step; returns finish order."""
    done, counter = [], itertools.count(500)
    for _ in range(max_steps):
        if not sched.has_work():
            return done
        scheduled = sched.schedule()
        assert scheduled, "nothing scheduled while work is pending"
        batch = sched.build_batch(scheduled)
        done += sched.postprocess(scheduled, [next(counter) for _ in batch.logits_indices])
        check_blocks(sched, bm)
        assert len(sched.running) <= sched.max_num_seqs
    raise AssertionError("did not finish")


def test_newest_sequence_is_preempted_and_later_finishes():
    # 3 blocks of 4: two 4-token prompts take one each; after sampling both need a second block,
    # only one is free, so the newer sequence must give way
    sched, bm = make(num_blocks=3)
    old, new = seq([10, 11, 12, 13], max_tokens=4), seq([20, 21, 22, 23], max_tokens=4)
    sched.add(old)
    sched.add(new)
    step(sched, token_ids=[30, 40])
    check_blocks(sched, bm)
    scheduled, _, _ = step(sched, token_ids=[31])
    assert scheduled == [(old, 1)]
    assert sched.num_preemptions == 1
    assert new.status is Status.WAITING and new.num_computed_tokens == 0
    assert new in sched.waiting and new not in sched.running
    assert new.output_token_ids == [40]  # what it sampled before is kept
    check_blocks(sched, bm)
    done = run_to_completion(sched, bm)
    assert done == [old, new]
    assert old.finish_reason == new.finish_reason == "length"
    assert len(old.output_token_ids) == len(new.output_token_ids) == 4
    assert new.output_token_ids[0] == 40
    assert bm.num_free_blocks == 3


def test_many_growing_sequences_in_a_tiny_pool_never_double_own_a_block():
    sched, bm = make(num_blocks=6, budget=8)
    # shared first block across prompts, so prefix-cache blocks are shared by live tables
    seqs = [seq([1, 2, 3, 4] + [10 * i + j for j in range(i % 3 + 1)], max_tokens=6)
            for i in range(5)]
    for s in seqs:
        sched.add(s)
    done = run_to_completion(sched, bm, max_steps=200)
    assert sorted(s.seq_id for s in done) == sorted(s.seq_id for s in seqs)
    assert all(len(s.output_token_ids) == 6 for s in seqs)
    assert sched.num_preemptions > 0  # the pool is small enough to force it
    assert any(s.num_cached_tokens for s in seqs)  # and later prompts did share the first block
    assert bm.num_free_blocks == 6


# ---------------------------------------------------------------- admission cap


def test_max_num_seqs_caps_admitted_sequences():
    sched, _ = make(max_num_seqs=2)
    seqs = [seq([5 + i, 6], max_tokens=1) for i in range(3)]
    for s in seqs:
        sched.add(s)
    scheduled, _, finished = step(sched)
    assert [s for s, _ in scheduled] == seqs[:2]  # budget would allow all three
    assert list(sched.waiting) == [seqs[2]]
    assert finished == seqs[:2]
    scheduled, _, finished = step(sched)
    assert [s for s, _ in scheduled] == [seqs[2]] and finished == [seqs[2]]


def test_max_num_seqs_counts_running_decodes():
    sched, _ = make(max_num_seqs=2)
    a, b, c = (seq([5 + i, 6], max_tokens=5) for i in range(3))
    for s in (a, b, c):
        sched.add(s)
    for _ in range(3):
        scheduled, _, _ = step(sched)
        assert c not in [s for s, _ in scheduled]
        assert len(sched.running) == 2
