"""How long the engine takes to notice each failure, and that the next request is served;
and, with dp=2, what one replica's dead rank does to the other replica's requests.

    .venv/bin/python -m bench.failure_times [--replicas-only]
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

from bench.common import machine
from engine import LLM, EngineError, SamplingParams

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
PROMPT = list(range(3, 40))


def _timed_failure(llm: LLM, inject) -> tuple[str, float]:
    inject()
    start = time.monotonic()
    try:
        llm.generate([PROMPT], PARAMS)
    except EngineError as e:
        return f"{type(e).__name__}: {str(e)[:90]}...", time.monotonic() - start
    return "no error", time.monotonic() - start


LONG = SamplingParams(max_tokens=50, ignore_eos=True)
ISOLATION_PROMPTS = [list(range(3 + i, 12 + i)) for i in range(8)]


def _kill_replica_1_midway(llm: LLM) -> tuple[list, float]:
    """8 requests at once, then SIGKILL of replica 1's rank once it has stepped a few times:
    each request's output or error, and when the kill happened."""
    async def run() -> tuple[list, float]:
        tasks = [asyncio.create_task(llm.generate_async(p, LONG)) for p in ISOLATION_PROMPTS]
        while len(llm.step_timings(1)) < 3:
            await asyncio.sleep(0.005)
        os.kill(llm.rank_pids()[1][0], signal.SIGKILL)
        killed = time.monotonic()
        return await asyncio.gather(*tasks, return_exceptions=True), killed
    return asyncio.run(run())


def replica_isolation(path: str, retry: bool) -> dict:
    """Requests of the healthy replica that failed or went wrong (any error not naming replica
    1 counts: the public API does not say where a request ran), and the seconds from the kill
    until replica 1 serves again (rebuilt by itself with retry, else by restart())."""
    with LLM(path) as ref:
        want = [g.token_ids for g in ref.generate(ISOLATION_PROMPTS, LONG)]
    with LLM(path, dp=2, step_timeout_s=30, retry_on_rank_failure=retry) as llm:
        old = llm.rank_pids()
        outs, killed = _kill_replica_1_midway(llm)
        errors = [o for o in outs if isinstance(o, BaseException)]
        wrong = [o for o, w in zip(outs, want) if not isinstance(o, BaseException) and o.token_ids != w]
        if not retry:
            llm.restart()
        while llm.rank_pids()[1] == old[1]:  # with retry: until the rebuilt replica is in
            time.sleep(0.01)
        served = llm.generate(ISOLATION_PROMPTS[:2], LONG)  # least loaded: one on each replica
        back = time.monotonic() - killed
        assert len(llm.step_timings(1)) > 0 and [g.token_ids for g in served] == want[:2]
    return {"retry": retry, "failed": len(errors), "healthy_failed":
            sum("replica 1" not in str(e) for e in errors) + len(wrong), "back_s": back}


def main() -> None:
    from engine.loading.synthetic import build
    from pathlib import Path
    import tempfile

    path = str(build("uneven", Path(tempfile.mkdtemp())))
    print(f"{machine()}; tiny model, Ray actors (their all-reduce through shared memory)")
    print("replica fault isolation (dp=2, tp=1; 8 requests of 50 tokens, replica 1's rank killed)")
    for retry in (False, True):
        r = replica_isolation(path, retry)
        print(f"  retry_on_rank_failure={retry}: {r['failed']} of 8 failed, "
              f"{r['healthy_failed']} on the healthy replica; replica 1 served again "
              f"{r['back_s']:.2f} s after the kill ({'rebuilt alone' if retry else 'restart()'})")
    if "--replicas-only" in sys.argv:
        return
    with LLM(path) as ref:
        want = ref.generate([PROMPT], PARAMS)[0].token_ids
    rows = []
    with LLM(path, tp=2, step_timeout_s=30, collective_timeout_s=5) as llm:
        cases = [
            ("rank 1 killed (SIGKILL) between requests", lambda: os.kill(llm.rank_pids()[0][1], signal.SIGKILL)),
            ("rank 0 killed (SIGKILL) between requests", lambda: os.kill(llm.rank_pids()[0][0], signal.SIGKILL)),
            ("rank 1 frozen (SIGSTOP): rank 0 hangs in all-reduce", lambda: os.kill(llm.rank_pids()[0][1], signal.SIGSTOP)),
        ]
        for name, inject in cases:
            pids = llm.rank_pids()[0]
            error, seconds = _timed_failure(llm, inject)
            for pid in pids:  # a frozen rank is killed by the teardown; let it go if not
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            llm.restart()
            ok = llm.generate([PROMPT], PARAMS)[0].token_ids == want
            rows.append((name, seconds, error, ok))
    print(f"{'failure':<52} {'detected in':>11}  {'next request after restart()':<28} error")
    for name, seconds, error, ok in rows:
        print(f"{name:<52} {seconds:>9.2f} s  {'correct' if ok else 'WRONG':<28} {error}")


if __name__ == "__main__":
    main()
