"""Failures are loud, bounded in time and harmless to the next request: dead and hung ranks,
poisoned inputs, corrupt checkpoints, cache exhaustion, requests from many threads."""
from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, ModelLoadError, NumericalError, RankFailure, SamplingParams

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPTS = [list(range(3, 3 + n)) for n in (9, 30, 17, 44)]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    path = str(tiny_model_dir("uneven"))
    with LLM(path) as llm:
        expected = [g.token_ids for g in llm.generate(PROMPTS, GREEDY)]
    return path, expected


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


def test_dead_rank_fails_fast_and_restart_serves(ray_cluster, model):
    path, expected = model
    with LLM(path, tp=2, step_timeout_s=10) as llm:
        pids = llm.rank_pids()[0]
        os.kill(pids[1], signal.SIGKILL)  # rank 1 dies between requests
        start = time.monotonic()
        with pytest.raises(RankFailure, match="rank 1"):
            llm.generate(PROMPTS, GREEDY)
        assert time.monotonic() - start < 10
        assert _wait_gone(pids), "a rank process outlived its group"
        with pytest.raises(RankFailure, match="restart"):
            llm.generate(PROMPTS, GREEDY)  # a broken group refuses work instead of hanging
        llm.restart()
        assert [g.token_ids for g in llm.generate(PROMPTS, GREEDY)] == expected


def test_rank_killed_mid_step_is_retried_when_asked(ray_cluster, model):
    path, expected = model
    with LLM(path, tp=2, step_timeout_s=10, retry_on_rank_failure=True) as llm:
        victim = llm.rank_pids()[0][0]
        killer = threading.Timer(0.3, os.kill, (victim, signal.SIGKILL))
        killer.start()  # rank 0 dies while the long generation is running
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=60, ignore_eos=True))
        killer.join()
        assert _gone(victim)
        # the requests ran again from their prompts on the new group: the same tokens
        assert [g.token_ids[:6] for g in outs] == expected


def test_hung_collective_is_caught_by_the_collective_timeout(ray_cluster, model):
    path, expected = model
    with LLM(path, tp=2, step_timeout_s=60, collective_timeout_s=3) as llm:
        pids = llm.rank_pids()[0]
        os.kill(pids[1], signal.SIGSTOP)  # rank 1 freezes: rank 0 waits in its all-reduce
        try:
            start = time.monotonic()
            with pytest.raises(RankFailure, match="rank"):
                llm.generate(PROMPTS[:1], GREEDY)
            assert time.monotonic() - start < 20  # the collective's 3 s, not the step's 60 s
        finally:
            if not _gone(pids[1]):
                os.kill(pids[1], signal.SIGCONT)
        assert _wait_gone(pids)
        llm.restart()
        assert llm.generate(PROMPTS[:1], GREEDY)[0].token_ids == expected[0]


def test_threads_and_a_tiny_cache_give_everyone_their_own_answer(model):
    path, expected = model
    # 6 blocks of 16 slots for 4 requests of up to 50 tokens: they queue and preempt
    per_block = 2 * 2 * 3 * 12 * 4 * 16
    with LLM(path, kv_cache_gb=6 * per_block / 2**30, max_model_len=96) as llm:
        results: dict[int, list[int]] = {}
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            try:
                results[i] = llm.generate([PROMPTS[i]], GREEDY)[0].token_ids
            except BaseException as e:  # reported below, with the thread's index
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors and [results[i] for i in range(len(PROMPTS))] == expected
        assert llm.cache_stats()["blocks_used"] == 0


def _edited_copy(src, dst, edit):
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, weights)
    return str(dst)


def test_corrupt_weights_are_refused(tiny_model_dir, tmp_path):
    src = tiny_model_dir("qwen2")

    def nan(t):
        t["model.norm.weight"][3] = float("nan")

    with pytest.raises(ModelLoadError, match="tensor model.norm.weight holds NaN"):
        LLM(_edited_copy(src, tmp_path / "nan", nan))

    def extra(t):
        t["model.layers.0.mlp.experts.weight"] = torch.zeros(2, 2)

    with pytest.raises(ModelLoadError, match="does not use.*experts"):
        LLM(_edited_copy(src, tmp_path / "extra", extra))


def test_nan_logits_fail_that_request_only(tiny_model_dir, tmp_path):
    """Token 7's embedding is finite in the float32 checkpoint but beyond float16's range: served
    in float16 it becomes Inf, and the sequences holding it turn to NaN. Prompts without it are
    fine. (An untied model: with tied embeddings the row would poison every logits vector.)"""
    src = tiny_model_dir("mistral")

    def poison(t):
        t["model.embed_tokens.weight"][7] = 1e6

    path = _edited_copy(src, tmp_path / "poison", poison)
    clean = [10, 11, 12, 13]
    with LLM(str(src), dtype="float16") as reference:
        want = reference.generate([clean], GREEDY)[0].token_ids
    with LLM(path, dtype="float16") as llm:
        with pytest.raises(NumericalError, match="NaN/Inf logits"):
            llm.generate([[5, 6, 7, 8]], GREEDY)
        assert llm.generate([clean], GREEDY)[0].token_ids == want
        assert llm.cache_stats()["blocks_used"] == 0
