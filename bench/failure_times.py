"""How long the engine takes to notice each failure, and that the next request is served.

    .venv/bin/python -m bench.failure_times
"""
from __future__ import annotations

import os
import signal
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


def main() -> None:
    from engine.loading.synthetic import build
    from pathlib import Path
    import tempfile

    path = str(build("uneven", Path(tempfile.mkdtemp())))
    print(f"{machine()}; tiny model, tp=2 on Ray actors, gloo")
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
