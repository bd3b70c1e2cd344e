"""One step loop serves every caller: threads share steps, asyncio requests stream and cancel,
restart()/shutdown() from another thread end in-flight requests, a request that outgrows the
whole cache keeps its tokens, a dropped LLM releases its ranks, and a rank error caused by one
request's settings fails that request alone."""
from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time

import pytest

from engine import LLM, ConfigError, InvalidRequestError, RankFailure, SamplingParams
from engine.loading.synthetic import random_token_ids

TOKENS = 24
GREEDY = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
PROMPTS = [random_token_ids(n, 300, seed=n) for n in (5, 9, 13, 17, 21, 25, 29, 33)]


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def expected(llama):
    with LLM(llama) as llm:
        return [g.token_ids for g in llm.generate(PROMPTS, GREEDY)]


def _steps(llm: LLM) -> int:
    return len(llm.step_timings())


def test_threads_share_steps_like_one_batched_call(llama, expected):
    with LLM(llama) as llm:
        llm.generate(PROMPTS, GREEDY)
        batched = _steps(llm)
        results: dict[int, list[int]] = {}
        start = threading.Barrier(len(PROMPTS))

        def one(i: int) -> None:
            start.wait()
            results[i] = llm.generate([PROMPTS[i]], GREEDY)[0].token_ids

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        threaded = _steps(llm) - batched
    assert [results[i] for i in range(len(PROMPTS))] == expected
    # serialised threads would take ~8x the steps; late arrivals may cost a few more steps
    assert batched == TOKENS and threaded <= 1.3 * batched, (batched, threaded)


@pytest.mark.parametrize("action", ["shutdown", "restart"])
def test_shutdown_or_restart_from_another_thread_ends_in_flight_requests(llama, expected, action):
    llm = LLM(llama)
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    outcome: list[BaseException] = []

    def request() -> None:
        try:
            llm.generate(PROMPTS, long)
        except BaseException as e:  # noqa: BLE001  the test asserts on it
            outcome.append(e)

    worker = threading.Thread(target=request)
    worker.start()
    while _steps(llm) < 3:  # the request is under way
        time.sleep(0.01)
    began = time.monotonic()
    getattr(llm, action)()
    worker.join(timeout=30)
    assert not worker.is_alive() and time.monotonic() - began < 30
    kind = InvalidRequestError if action == "shutdown" else RankFailure
    assert len(outcome) == 1 and isinstance(outcome[0], kind), outcome
    assert ("shut down" if action == "shutdown" else "restarted") in str(outcome[0])
    if action == "restart":  # the restarted engine serves as before
        assert llm.generate(PROMPTS[:2], GREEDY)[0].token_ids == expected[0]
        assert llm.cache_stats()["blocks_used"] == 0
    else:
        with pytest.raises(InvalidRequestError, match="shut down"):
            llm.generate(PROMPTS[:1], GREEDY)
    llm.shutdown()


def test_asyncio_generate_stream_and_cancel(llama, expected, caplog):
    async def main(llm: LLM) -> None:
        outs = await asyncio.gather(*(llm.generate_async(p, GREEDY) for p in PROMPTS[:3]))
        assert [o.token_ids for o in outs] == expected[:3]
        streamed = [t async for t in llm.stream(PROMPTS[3], GREEDY)]
        assert streamed == expected[3]
        endless = SamplingParams(max_tokens=10_000, ignore_eos=True)  # stops at max_model_len
        task = asyncio.create_task(llm.generate_async(PROMPTS[4], endless))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        tokens = llm.stream(PROMPTS[5], endless)  # a stream closed early cancels its request
        assert await tokens.__anext__() == expected[5][0]
        await tokens.aclose()

    with LLM(llama, max_model_len=256) as llm:
        asyncio.run(main(llm))
        # the cancelled request's blocks came back
        deadline = time.monotonic() + 10
        while llm.cache_stats()["blocks_used"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert llm.cache_stats()["blocks_used"] == 0
    # the early-closed stream's last tokens and its end came after asyncio.run closed its loop:
    # dropped quietly, not raised into the step loop or a future's callback
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_a_cache_too_small_for_one_request_is_refused_and_the_longest_keeps_its_tokens(llama):
    """Once, a prompt that fit but whose output outgrew the whole cache ended in an internal
    error and lost its tokens. Now the cache must hold one request of max_model_len."""
    per_block = 2 * 2 * 2 * 16 * 4 * 16  # k+v, 2 layers, 2 KV heads, head dim 16, fp32, 16 slots
    small = 4 * per_block / 2**30
    with pytest.raises(ConfigError, match="holds 4 blocks .*max_model_len=256 .*16 blocks"):
        LLM(llama, kv_cache_gb=small)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    prompt = random_token_ids(40, 300, seed=1)
    with LLM(llama) as roomy:
        want = roomy.generate([prompt], params)[0].token_ids
    with LLM(llama, kv_cache_gb=small, max_model_len=64) as llm:  # the whole pool: 64 slots
        [out] = llm.generate([prompt], params)
        assert out.finish_reason == "length" and out.token_ids == want[:64 - 40]
        assert llm.cache_stats()["blocks_used"] == 0


def test_dropped_llm_releases_its_ranks(ray_cluster, llama):
    """The session cluster has 4 CPUs: two leaked tp=2 engines would leave no room for a third."""
    for _ in range(2):
        llm = LLM(llama, tp=2, init_timeout_s=30)
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))
        del llm
        gc.collect()
    with LLM(llama, tp=2, init_timeout_s=30) as llm:
        assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))[0].token_ids


def test_shutdown_gives_the_kv_cache_memory_back_while_the_cache_is_still_referenced(llama):
    """On an H200 torch 2.11's compiler kept a compiled call's scope (a step context, so the
    cache) after the engine shut down, and the next engine found ~120 GiB taken. A reference
    held here stands in for that one: shutdown must free the memory regardless."""
    llm = LLM(llama)
    cache = llm._core.replicas[0]._ranks.worker.cache
    blocks = cache.num_blocks
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))
    assert cache.data.shape[2] == blocks > 0
    llm.shutdown()
    assert cache.nbytes == 0 and cache.num_blocks == 0


def test_a_rank_error_from_one_request_fails_it_alone(tiny_model_dir):
    """The driver refuses every bad setting it knows of; should sampling still raise on rank 0
    for one request's spec, the worker reports that row and samples the others (at TP>1 a raise
    on rank 0 alone would read as a broken group), and the driver fails that request alone."""
    from engine.batch import SamplingSpec
    from engine.config import EngineConfig
    from engine.driver.block_manager import BlockManager
    from engine.driver.engine_core import _resolve
    from engine.driver.scheduler import Scheduler
    from engine.driver.sequence import FinishReason, Sequence
    from engine.loading.checkpoint import open_checkpoint
    from engine.plan import make_plan
    from engine.rank.worker import Worker

    path = str(tiny_model_dir("uneven"))
    ckpt = open_checkpoint(path)
    worker = Worker(make_plan(EngineConfig(model=path), path, ckpt.config), checkpoint=ckpt)
    blocks = BlockManager(worker.plan.num_blocks, 16)
    scheduler = Scheduler(blocks, 64, 8, 256, [])
    seqs = [Sequence(p, GREEDY) for p in PROMPTS[:3]]
    for seq in seqs:
        scheduler.add(seq)
    scheduled = scheduler.schedule()
    batch = scheduler.build_batch(scheduled)
    batch.sampling[1] = SamplingSpec(temperature=1.0, seed=1.5)  # a float seed has no bytes
    result = worker.execute(batch)
    assert list(result.row_errors) == [1] and "AttributeError" in result.row_errors[1]
    scheduler.postprocess(scheduled, result.token_ids, None, set(), result.row_errors)
    for seq in seqs:
        _resolve(seq)
    assert seqs[1].finish_reason is FinishReason.ERROR
    with pytest.raises(InvalidRequestError, match="sampling failed"):
        seqs[1].future.result()
    assert seqs[0].finish_reason is None and seqs[0].output_token_ids  # the others sampled


def test_restart_from_the_step_loop_is_refused():
    """Code running on the step-loop thread (as a request's callback would) cannot restart the
    engine under itself: that would leave two loops stepping the same ranks."""
    from engine.driver.engine_core import EngineCore
    from engine.errors import InvalidRequestError

    core = EngineCore(lambda: [], retry_on_rank_failure=False, routing="least_loaded")
    try:
        with pytest.raises(InvalidRequestError, match="from another thread"):
            core.call(core.restart)
        assert core.call(lambda: 42) == 42  # still serving
    finally:
        core.shutdown()


def test_breaking_out_of_a_stream_under_aclosing_frees_its_request(llama, expected):
    """docs/settings.md's pattern: `async with contextlib.aclosing(llm.stream(...))` drops the request
    at the `break`, while the event loop still runs (not when the generator is collected)."""
    from contextlib import aclosing

    endless = SamplingParams(max_tokens=10_000, ignore_eos=True)  # stops at max_model_len

    async def main(llm: LLM) -> tuple[list[int], int]:
        got = []
        async with aclosing(llm.stream(PROMPTS[2], endless)) as tokens:
            async for token in tokens:
                got.append(token)
                if len(got) == 3:
                    break
        for _ in range(200):  # the cancel reaches the step loop within a step or two
            if llm.cache_stats()["blocks_used"] == 0:
                break
            await asyncio.sleep(0.01)
        return got, llm.cache_stats()["blocks_used"]

    with LLM(llama, max_model_len=256) as llm:
        got, used = asyncio.run(main(llm))
    assert got == expected[2][:3] and used == 0


def test_a_request_reaches_a_decoder_layer_in_seven_hops(llama, monkeypatch):
    """Issue 23's hop budget, the path the README gives: `LLM.generate` calls
    `EngineCore.submit` itself (1); the loop thread's `EngineCore.step` (2) reaches
    `Worker.execute` through `Replica.launch` and the ranks' `launch` (here the in-process
    rank) (3-5), which runs `CausalLM.forward` (6) and so `DecoderLayer.forward` (7), with
    nothing of the engine's between."""
    import traceback
    from pathlib import Path

    from engine.driver.engine_core import EngineCore
    from engine.rank.model import DecoderLayer

    root = str(Path(__file__).resolve().parents[1])
    stacks: dict[str, list[str]] = {}
    forward, submit = DecoderLayer.forward, EngineCore.submit

    def ours(name: str) -> list[str]:  # the engine's own frames, not torch's module calls
        stacks.setdefault(name, [f.name for f in traceback.extract_stack()[:-2]
                                 if f.filename.startswith(root) and "/.venv/" not in f.filename])

    def recording_forward(layer, *args):
        ours("layer")
        return forward(layer, *args)

    def recording_submit(core, seqs):
        ours("submit")
        return submit(core, seqs)

    monkeypatch.setattr(EngineCore, "submit", recording_submit)
    with LLM(llama) as llm:
        # the request's layers, not those of the decode step the rank timed at start-up
        monkeypatch.setattr(DecoderLayer, "forward", recording_forward)
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1))
    assert stacks["submit"][-1] == "generate"
    loop = stacks["layer"]
    path = loop[loop.index("_run") + 1:]  # _run: the loop thread's target, looping on step
    # generate -> submit (1), these five (2-6), then the layer (7)
    assert path == ["step", "launch", "launch", "execute", "forward"]
