"""Why the engine keeps one OpenMP team per process: decode speed of an in-process engine alone in
its process, against the same engine in a process whose main thread has also run one parallel
torch op (a matmul), as a caller loading weights or running a baseline model would. Each case
runs in a fresh process of its own.

    .venv/bin/python -m bench.openmp_teams
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import time


def decode_tok_s(second_team: bool, prompt_len: int, tokens: int, repeats: int) -> float:
    import torch

    from bench.common import random_ids
    from engine import LLM, SamplingParams

    if second_team:  # libgomp gives this thread a team of its own, beside the step loop's
        torch.randn(512, 512) @ torch.randn(512, 512)
    with LLM("smollm2", enable_prefix_caching=False) as llm:
        ids = random_ids(prompt_len, llm.model_config.vocab_size, seed=1)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            [g] = llm.generate([ids], SamplingParams(max_tokens=tokens, ignore_eos=True))
            best = min(best, (time.perf_counter() - start - g.ttft_s) / (tokens - 1))
    return 1 / best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from bench.common import machine

    ctx = mp.get_context("spawn")
    with ctx.Pool(1, maxtasksperchild=1) as pool:  # a fresh process for each case
        alone, shared = (pool.apply(decode_tok_s, (second, args.prompt_len, args.tokens,
                                                   args.repeats)) for second in (False, True))
    print(f"{machine()}; SmolLM2 float32, {args.prompt_len}-token prompt, {args.tokens} tokens")
    print(f"engine alone in its process          {alone:6.1f} tok/s")
    print(f"main thread also ran a parallel op   {shared:6.1f} tok/s   ({alone / shared:.2f}x slower)")


if __name__ == "__main__":
    main()
