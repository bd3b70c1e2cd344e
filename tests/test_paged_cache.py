"""Paged KV cache, chunked prefill, batching and prefix caching change how the work is cut,
never the answer: each case is compared with the same prompt prefilled alone, in one piece, in
an empty cache. At TP=1 and TP=2."""
from __future__ import annotations

import pytest

from engine import LLM
from engine import SamplingParams
from engine.loading.synthetic import random_token_ids

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
BYTES_PER_BLOCK = 2 * 2 * 2 * 16 * 4 * 16  # k+v, 2 layers, 2 KV heads, head dim 16, fp32, 16 slots


def _ids(n: int, seed: int) -> list[int]:
    return random_token_ids(n, 311, seed)


PROMPTS = [_ids(n, seed=n) for n in (37, 5, 64, 1, 23)]
SHARED = _ids(48, seed=99)  # three full blocks shared by the prefix-cache prompts


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return str(tiny_model_dir("qwen2"))


@pytest.fixture(scope="module")
def alone(model_path):
    """Each prompt on its own in a fresh engine: logits and greedy tokens."""
    out = {}
    with LLM(model_path, enable_prefix_caching=False) as llm:
        for ids in PROMPTS + [SHARED + [7, 8, 9], SHARED + _ids(20, seed=5)]:
            [p] = llm.prefill([ids])
            [g] = llm.generate([ids], GREEDY)
            out[tuple(ids)] = (p.logits, g.token_ids)
    return out


def _check(alone, ids, logits=None, tokens=None):
    ref_logits, ref_tokens = alone[tuple(ids)]
    if logits is not None:
        assert (logits - ref_logits).abs().max().item() <= 1e-4
    if tokens is not None:
        assert tokens == ref_tokens


@pytest.fixture(params=[1, 2], ids=["tp1", "tp2"], scope="module")
def tp(request):
    if request.param > 1:
        request.getfixturevalue("ray_cluster")
    return request.param


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_matches_one_pass(model_path, alone, tp, chunk):
    with LLM(model_path, tp=tp, max_num_batched_tokens=chunk, enable_prefix_caching=False) as llm:
        for ids in PROMPTS[:3]:
            [p] = llm.prefill([ids])
            _check(alone, ids, logits=p.logits)
        steps_before = len(llm.step_timings())
        [g] = llm.generate([PROMPTS[0]], GREEDY)
        _check(alone, PROMPTS[0], tokens=g.token_ids)
        # a 37-token prompt takes ceil(37/chunk) prefill steps, then one step per further token
        assert len(llm.step_timings()) - steps_before == -(-37 // chunk) + GREEDY.max_tokens - 1


def test_batched_prompts_match_alone(model_path, alone, tp):
    with LLM(model_path, tp=tp, enable_prefix_caching=False) as llm:
        outs = llm.prefill(PROMPTS)
        for ids, p in zip(PROMPTS, outs):
            _check(alone, ids, logits=p.logits)
        assert len(llm.step_timings()) == 1  # all five prompts in one forward pass
        for ids, g in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
            _check(alone, ids, tokens=g.token_ids)


def test_prefix_cache_hit_matches_empty_cache(model_path, alone, tp):
    first, second = SHARED + [7, 8, 9], SHARED + _ids(20, seed=5)
    with LLM(model_path, tp=tp) as llm:
        [a] = llm.prefill([first])
        assert a.cached_tokens == 0
        [b] = llm.prefill([second])
        assert b.cached_tokens == 48  # the three full shared blocks
        _check(alone, second, logits=b.logits)
        [g] = llm.generate([second], GREEDY)
        _check(alone, second, tokens=g.token_ids)
        assert g.cached_tokens == 64  # now its own fourth block is cached too
        # a prompt that is wholly cached still recomputes its last block to get logits
        [again] = llm.prefill([first])
        assert again.cached_tokens == 48
        _check(alone, first, logits=again.logits)
        assert llm.cache_stats()["prefix_hit_tokens"] == 48 + 64 + 48


def test_small_pool_evicts_and_preempts_without_changing_answers(model_path, alone, tp):
    # 8 blocks of 16 slots: not enough for all five prompts plus their decodes at once. The
    # budget is per rank, and at TP=2 a rank holds one of the two KV heads.
    with LLM(model_path, tp=tp, kv_cache_gb=8 * BYTES_PER_BLOCK / tp / 2**30,
             max_model_len=128) as llm:  # the pool must hold one request of max_model_len
        assert llm.cache_stats()["blocks_total"] == 8
        for _ in range(2):
            for ids, g in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
                _check(alone, ids, tokens=g.token_ids)
        stats = llm.cache_stats()
        assert stats["preemptions"] > 0 and stats["blocks_used"] == 0


def test_forced_hash_collisions_are_never_served(model_path, alone):
    with LLM(model_path) as llm:
        llm._core.replicas[0].block_manager.hash_fn = lambda parent, tokens: 42  # every block collides
        first, second = SHARED + [7, 8, 9], SHARED + _ids(20, seed=5)
        llm.prefill([first])
        [b] = llm.prefill([second])
        _check(alone, second, logits=b.logits)
        # only the first block may be served: every later key points at it, at another position
        assert b.cached_tokens == 16
        assert llm.cache_stats()["hash_collisions"] > 0
