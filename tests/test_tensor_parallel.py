"""TP=N on real Ray actors and gloo against TP=1: logits, greedy tokens, each rank's KV slice."""
from __future__ import annotations

import time

import pytest
import torch

from engine import LLM, ConfigError, SamplingParams
from parallel.partition import partition_heads

STEPS = 32


from engine.loading.synthetic import random_token_ids as _ids
from tests.cpu_features import HUGE_PAGES_ON, huge_page_kb


def _run(llm: LLM, ids: list[int]) -> dict:
    [p] = llm.prefill([ids])
    [g] = llm.generate([ids], SamplingParams(max_tokens=STEPS, ignore_eos=True))
    kv = [llm.read_kv(layer, p.block_table, len(ids)) for layer in range(llm.model_config.num_layers)]
    return {"logits": p.logits, "tokens": g.token_ids, "kv": kv}


def _assert_same_as_single_rank(ref: dict, got: dict, llm: LLM) -> None:
    assert (got["logits"] - ref["logits"]).abs().max().item() <= 1e-4
    assert got["tokens"] == ref["tokens"]
    mc = llm.model_config
    parts = partition_heads(mc.num_heads, mc.num_kv_heads, llm.config.tp)
    for layer, per_rank in enumerate(got["kv"]):
        [(k_full, v_full)] = ref["kv"][layer]
        assert len(per_rank) == llm.config.tp
        for part, (k, v) in zip(parts, per_rank):
            a, b = part.kv_heads
            assert k.shape[1] == b - a  # a rank holds only its own heads
            torch.testing.assert_close(k, k_full[:, a:b], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v, v_full[:, a:b], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def uneven(tiny_model_dir):
    """6 query / 3 KV heads, vocab 301, FFN 100: nothing divides evenly by 2, 3 or 4."""
    path = str(tiny_model_dir("uneven"))
    ids = _ids(45, 301, seed=3)
    with LLM(path) as llm:
        return path, ids, _run(llm, ids)


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_uneven_model_matches_single_rank(ray_cluster, uneven, tp):
    path, ids, ref = uneven
    with LLM(path, tp=tp) as llm:
        assert [i.rank for i in llm.rank_info()] == list(range(tp))
        assert len(set(ip for ip, _ in llm.placement()[0])) == 1  # one TP group, one node
        _assert_same_as_single_rank(ref, _run(llm, ids), llm)
        # per-rank weight bytes add up to more than nothing and less than a full copy each
        total = sum(i.weight_bytes for i in llm.rank_info())
        assert all(i.weight_bytes < total for i in llm.rank_info())


@pytest.mark.parametrize("tp", [2, 3])
def test_smollm2_matches_single_rank(ray_cluster, smollm2_llm, tp):
    ids = smollm2_llm.tokenizer.encode("Tensor parallelism splits every layer across ranks, so")
    ref = _run(smollm2_llm, ids)
    with LLM("smollm2", tp=tp) as llm:
        _assert_same_as_single_rank(ref, _run(llm, ids), llm)
        if HUGE_PAGES_ON:  # each actor moved its shard's weights (engine.rank.host_memory)
            for info in llm.rank_info():
                assert info.huge_page_bytes >= 2**27, info
                assert huge_page_kb(info.pid) * 1024 >= info.huge_page_bytes


def test_data_parallel_replicas_serve_every_request(ray_cluster, uneven):
    path, _, _ = uneven
    prompts = [_ids(n, 301, seed=n) for n in (5, 17, 33, 9)]
    with LLM(path) as single:
        expected = [g.token_ids for g in single.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))]
    with LLM(path, tp=1, dp=2, executor="ray") as llm:
        assert len(llm.placement()) == 2
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        assert [g.token_ids for g in outs] == expected
        # both replicas took requests
        assert all(stats["prefix_lookup_tokens"] > 0 for stats in llm.cache_stats()["replicas"])


def test_impossible_parallel_configs_fail_fast(ray_cluster, uneven):
    path, _, _ = uneven
    with pytest.raises(ConfigError, match="tp=0"):
        LLM(path, tp=0)
    with pytest.raises(ConfigError, match="exceeds the 6 attention heads"):
        LLM(path, tp=7)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="need 6 CPUs"):
        LLM(path, tp=3, dp=2)  # the test cluster has 4 CPUs
    assert time.perf_counter() - start < 10
