"""Eight threads with one prompt each against one call with the same eight prompts: the step
loop should batch the threads into shared steps (issue 11's goal: time ratio <= 1.3x).

    .venv/bin/python -m bench.thread_batching
"""
from __future__ import annotations

import threading
import time

from bench.common import machine
from engine import LLM, SamplingParams
from engine.loading.synthetic import random_token_ids

PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


def _threads(llm: LLM, prompts: list[list[int]]) -> float:
    start, barrier = time.perf_counter(), threading.Barrier(len(prompts))

    def one(prompt: list[int]) -> None:
        barrier.wait()
        llm.generate([prompt], PARAMS)

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def main() -> None:
    print(f"{machine()}; SmolLM2, tp=1, 8 prompts of 32-256 tokens, 24 greedy tokens each")
    with LLM("smollm2", enable_prefix_caching=False) as llm:
        prompts = [random_token_ids(32 * (i + 1), llm.model_config.vocab_size, seed=i)
                   for i in range(8)]
        llm.generate(prompts[:1], PARAMS)  # warm-up
        rows = []
        for name, run in (("one call of 8", lambda: llm.generate(prompts, PARAMS)),
                          ("8 threads of 1", lambda: _threads(llm, prompts))):
            before, start = len(llm.step_timings()), time.perf_counter()
            run()
            rows.append((name, time.perf_counter() - start, len(llm.step_timings()) - before))
    print(f"{'how':<16} {'seconds':>8} {'steps':>6}")
    for name, seconds, steps in rows:
        print(f"{name:<16} {seconds:>8.2f} {steps:>6}")
    print(f"threads / one call: {rows[1][1] / rows[0][1]:.2f}x time, "
          f"{rows[1][2] / rows[0][2]:.2f}x steps")


if __name__ == "__main__":
    main()
