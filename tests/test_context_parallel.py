"""Context parallelism (cp ranks, each possibly tensor-parallel) against one rank: logits,
greedy tokens, and each rank's KV cache against the matching positions and heads of the
single-rank cache. The split, the attention merge and the refusals are checked by hand too."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, ConfigError, InvalidRequestError, SamplingParams
from engine.loading.synthetic import random_token_ids as _ids
from parallel.partition import partition_heads
from parallel.ring import lse_merge, partial_attention

# 45 and 17 divide by neither 4 nor 6; 3 is shorter than 2·cp for cp = 2 and 3
PROMPTS = [(45, 3), (3, 4), (17, 5)]
STEPS = 32
CP_ONLY = dict(enable_prefix_caching=False)


def _expected_positions(length: int, cp: int, c: int) -> list[int]:
    """By hand: 2·cp chunks, the first length % (2·cp) one token longer; rank c takes chunk c
    and chunk 2·cp-1-c."""
    n = 2 * cp
    sizes = [length // n + (1 if i < length % n else 0) for i in range(n)]
    starts = [sum(sizes[:i]) for i in range(n)]
    return [p for i in (c, n - 1 - c) for p in range(starts[i], starts[i] + sizes[i])]


def test_balanced_split_by_hand():
    from parallel import cp_layout

    # 45 tokens, cp=2: chunks of 12, 11, 11, 11; rank 0 takes the first and the last
    assert cp_layout.prompt_chunks(45, 2, 0) == [(0, 12), (34, 45)]
    assert cp_layout.prompt_chunks(45, 2, 1) == [(12, 23), (23, 34)]
    # every position has exactly one owner, prompts shorter than 2·cp included
    for length in (1, 3, 17, 45):
        for cp in (2, 3):
            owned = [_expected_positions(length, cp, c) for c in range(cp)]
            assert sorted(p for o in owned for p in o) == list(range(length))
            for c in range(cp):
                assert cp_layout.local_count(length, length, cp, c) == len(owned[c])
    # generated tokens go round the ranks: positions 45.. of a 45-token prompt, cp=2
    assert [cp_layout.owner(p, 45, 2) for p in range(45, 49)] == [1, 0, 1, 0]


def test_log_sum_exp_merge_equals_whole_softmax():
    """Attention over keys split three ways, merged, against SDPA over all keys (plain torch)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(7, 6, 8), torch.randn(20, 3, 8), torch.randn(20, 3, 8)
    heads = torch.tensor([0, 0, 1, 1, 2, 2])
    mask = torch.arange(20).unsqueeze(0) <= torch.arange(13, 20).unsqueeze(1)  # causal, last 7
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.index_select(1, heads).transpose(0, 1),
        v.index_select(1, heads).transpose(0, 1), attn_mask=mask, scale=0.3).transpose(0, 1)
    parts = [(0, 5), (5, 14), (14, 20)]
    outs, lses = zip(*(partial_attention(q, k[a:b], v[a:b], mask[:, a:b], heads, 0.3)
                       for a, b in parts))
    torch.testing.assert_close(lse_merge(list(outs), list(lses)), ref, atol=1e-5, rtol=1e-5)
    # a part no query may see (all masked) weighs nothing
    empty = partial_attention(q, k[:2], v[:2], torch.zeros(7, 2, dtype=torch.bool), heads, 0.3)
    torch.testing.assert_close(lse_merge([*outs, empty[0]], [*lses, empty[1]]), ref,
                               atol=1e-5, rtol=1e-5)


def _run(llm: LLM, prompts: list[list[int]]) -> dict:
    pre = llm.prefill(prompts)
    # read before anything else runs in these blocks
    kv = [[llm.read_kv(layer, p.block_table, len(ids)) for layer in
           range(llm.model_config.num_layers)] for p, ids in zip(pre, prompts)]
    gen = llm.generate(prompts, SamplingParams(max_tokens=STEPS, ignore_eos=True))
    return {"logits": [p.logits for p in pre], "tokens": [g.token_ids for g in gen], "kv": kv}


@pytest.fixture(scope="module")
def single(tiny_model_dir):
    """6 query / 3 KV heads, vocab 301, FFN 100, on one rank."""
    path = str(tiny_model_dir("uneven"))
    prompts = [_ids(n, 301, seed=s) for n, s in PROMPTS]
    with LLM(path) as llm:
        ref = _run(llm, prompts)
        ref["one_token"] = llm.prefill([[7]])[0].logits
        return path, prompts, ref


@pytest.mark.parametrize("cp,tp", [(2, 1), (3, 1), (2, 2)])
def test_context_parallel_matches_single_rank(ray_cluster, single, cp, tp):
    path, prompts, ref = single
    with LLM(path, cp=cp, tp=tp, **CP_ONLY) as llm:
        got = _run(llm, prompts)
        # a step of one 1-token prompt: context ranks past the first have no token at all
        one_token = llm.prefill([[7]])[0].logits
        assert (one_token - ref["one_token"]).abs().max().item() <= 1e-4
        assert len(llm.rank_info()) == cp * tp
        assert llm.step_timings()[0].num_seqs == len(prompts)  # all three packed in one step
        mc = llm.model_config
    for a, b in zip(got["logits"], ref["logits"]):
        assert (a - b).abs().max().item() <= 1e-4
    assert got["tokens"] == ref["tokens"]
    heads = partition_heads(mc.num_heads, mc.num_kv_heads, tp)
    for ids, per_layer, ref_layers in zip(prompts, got["kv"], ref["kv"]):
        for per_rank, [(k_full, v_full)] in zip(per_layer, ref_layers):
            assert len(per_rank) == cp * tp
            for rank, (k, v) in enumerate(per_rank):
                positions = _expected_positions(len(ids), cp, rank // tp)
                a, b = heads[rank % tp].kv_heads
                assert k.shape[:2] == (len(positions), b - a)  # its positions, its heads only
                torch.testing.assert_close(k, k_full[positions, a:b], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(v, v_full[positions, a:b], atol=1e-5, rtol=1e-5)


def test_unsupported_context_parallel_settings_are_refused(ray_cluster, tiny_model_dir):
    path = str(tiny_model_dir("uneven"))
    with pytest.raises(ConfigError, match="enable_prefix_caching=True with cp=2"):
        LLM(path, cp=2)
    with pytest.raises(ConfigError, match="max_num_batched_tokens=64 with cp=2"):
        LLM(path, cp=2, max_num_batched_tokens=64, **CP_ONLY)
    with pytest.raises(ConfigError, match="overlap_comm=True with cp=2"):
        LLM(path, cp=2, tp=2, overlap_comm=True, **CP_ONLY)
    with pytest.raises(ConfigError, match="cp=0"):
        LLM(path, cp=0)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"1 replica\(s\) x cp=3 x tp=2 need 6 CPUs but the Ray "
                       r"cluster has 4, 2 short"):
        LLM(path, cp=3, tp=2, **CP_ONLY)  # the test cluster has 4 CPUs
    assert time.perf_counter() - start < 10


def test_rank_stuck_mid_ring_fails_the_step_within_its_timeout(ray_cluster, single):
    """Context rank 1 frozen: rank 0 sends its K/V chunk and waits for rank 1's, which never
    comes. The step fails as a RankFailure naming a rank within step_timeout_s, as with TP."""
    import os
    import signal

    from engine import RankFailure

    path, prompts, _ = single
    with LLM(path, cp=2, step_timeout_s=5, **CP_ONLY) as llm:
        victim = llm.rank_pids()[0][1]
        os.kill(victim, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(RankFailure, match="rank"):
                llm.prefill(prompts[:1])
            assert time.monotonic() - start < 5 + 3  # the bound, plus the teardown
        finally:
            os.kill(victim, signal.SIGCONT)


def test_a_prompt_that_does_not_fit_waits_whole(ray_cluster, tiny_model_dir):
    """A 64-token step budget and prompts of 45 and 40 tokens: the plain scheduler would chunk
    one; with cp > 1 it waits for the next step and runs whole, same tokens as one rank."""
    path = str(tiny_model_dir("uneven"))
    prompts = [_ids(45, 301, seed=8), _ids(40, 301, seed=9)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    settings = dict(max_model_len=64, max_num_batched_tokens=64, **CP_ONLY)
    with LLM(path, **settings) as llm:
        expected = [g.token_ids for g in llm.generate(prompts, params)]
    with LLM(path, cp=2, **settings) as llm:
        assert [g.token_ids for g in llm.generate(prompts, params)] == expected
        first, second = llm.step_timings()[:2]
    # shortest first: the 40 runs, the 45 does not fit beside it and waits, then runs whole
    assert (first.num_tokens, first.num_seqs) == (40, 1)
    assert (second.num_tokens, second.num_seqs) == (1 + 45, 2)


def test_scoring_and_kv_export_are_refused_with_cp(ray_cluster, tiny_model_dir):
    path = str(tiny_model_dir("uneven"))
    with LLM(path, cp=2, enable_prefix_caching=False) as llm:
        with pytest.raises(InvalidRequestError, match="score\\(\\) is not supported with cp=2"):
            llm.score([[5, 6, 7, 8]])
        with pytest.raises(InvalidRequestError, match="export_kv=True\\) is not supported"):
            llm.prefill([[5, 6, 7, 8]], export_kv=True)
        with pytest.raises(InvalidRequestError, match="walkthrough\\(\\) is not supported"):
            llm.walkthrough([5, 6, 7, 8])
        with pytest.raises(InvalidRequestError, match="tracing\\(\\) is not supported"):
            with llm.tracing():
                pass
        assert llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2))[0].token_ids  # serving


def test_most_positions_one_rank_holds_by_brute_force():
    """max_held against every prompt length and every rank: never exceeded, often reached."""
    from parallel import cp_layout

    for cp in (2, 3, 4):
        reached = 0
        for length in range(1, 100):
            most = max(cp_layout.local_count(length, prompt, cp, c)
                       for prompt in range(1, length + 1) for c in range(cp))
            assert most <= cp_layout.max_held(length, cp), (cp, length)
            reached += most == cp_layout.max_held(length, cp)
            # a whole prompt alone: its 2·cp chunks give no rank more than ceil(length / cp)
            assert max(cp_layout.local_count(length, length, cp, c)
                       for c in range(cp)) == -(-length // cp)
        assert reached > 30  # the bound is the real worst case, not a loose one
    assert cp_layout.max_held(45, 1) == 45


def test_a_context_rank_pools_only_its_slice(ray_cluster, tiny_model_dir):
    """3 blocks of 16 positions per rank: too few for one 64-token request on one rank (4
    blocks), enough at cp=2 (a rank keeps at most 33 of 64). Two 60-token prompts, each needing
    4 blocks whole, run one after the other in 2-3 blocks and match one rank."""
    path = str(tiny_model_dir("uneven"))
    # by hand: K and V x 2 layers x 3 KV heads x head dim 12 x 4 bytes, per position per rank
    per_token = 2 * 2 * 3 * 12 * 4
    pool = 3 * 16 * per_token
    settings = dict(max_model_len=64, block_size=16, enable_prefix_caching=False)
    small = dict(kv_cache_gb=pool / 2**30, **settings)
    with pytest.raises(ConfigError, match=r"holds 3 blocks .* max_model_len=64 \(4 blocks\)"):
        LLM(path, **small)
    with pytest.raises(ConfigError, match=r"one of cp=2 ranks keeps at most 33 \(3 blocks\)"):
        LLM(path, cp=2, **{**small, "kv_cache_gb": 2 * 16 * per_token / 2**30})
    prompts = [_ids(60, 301, seed=11), _ids(60, 301, seed=12)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with LLM(path, **settings) as llm:
        ref_logits = [p.logits for p in llm.prefill(prompts)]
        ref_tokens = [g.token_ids for g in llm.generate(prompts, params)]
    with LLM(path, cp=2, **small) as llm:
        info = llm.rank_info()
        assert [(i.num_blocks, i.kv_cache_bytes) for i in info] == [(3, pool)] * 2
        pre = llm.prefill(prompts)
        assert [len(p.block_table) for p in pre] == [2, 2]  # ceil(31 / 16): a rank holds 30
        tokens = [g.token_ids for g in llm.generate(prompts, params)]
        with pytest.raises(InvalidRequestError, match="prefix caching is not supported"):
            with llm.prefix_caching(True):
                pass
    assert tokens == ref_tokens
    for got, ref in zip(pre, ref_logits):
        assert (got.logits - ref).abs().max().item() <= 1e-4


def test_a_preempted_sequence_comes_back_as_a_longer_prompt(ray_cluster, tiny_model_dir):
    """Two sequences outgrow a 3-block pool at cp=2; the newest gives way and is recomputed as
    one prompt of its tokens so far, which the ranks split afresh: same tokens as one rank."""
    path = str(tiny_model_dir("uneven"))
    settings = dict(max_model_len=64, block_size=16, enable_prefix_caching=False)
    prompts = [_ids(20, 301, seed=1), _ids(23, 301, seed=2)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    with LLM(path, **settings) as llm:
        expected = [g.token_ids for g in llm.generate(prompts, params)]
    with LLM(path, cp=2, kv_cache_gb=3 * 16 * 576 / 2**30, **settings) as llm:
        assert [g.token_ids for g in llm.generate(prompts, params)] == expected
        assert llm.cache_stats()["preemptions"] >= 1
