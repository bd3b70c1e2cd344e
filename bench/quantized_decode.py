"""Prefill and decode speed of SmolLM2 with each `weights` setting, side by side in one run:
float (weights=None), int8, int4 and gguf (the file's Q4_1 blocks as stored). Each round opens
one engine per setting in turn (one engine alive at a time: two step loops in one process slow
each other), times a prefill of the prompt and a greedy decode after it, and closes it; the
best round of each setting is kept. Tokens are compared with the float run's. With
--eager-too each setting also runs with compile=False, beside its default (compiled where
engine.plan.compiles says so: bf16 on a CPU whose oneDNN multiplies bf16).

    .venv/bin/python -m bench.quantized_decode --rounds 3 --dtype float32 [--threads 1] [--eager-too]
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.common import machine, print_table, random_ids
from engine import LLM, SamplingParams

SETTINGS = (None, "int8", "int4", "gguf")


def one_round(weights: str | None, compile: bool | None, dtype: str, prompt_len: int,
              tokens: int, threads: int | None) -> tuple[float, float, int, list[int]]:
    """(prefill tok/s, decode tok/s, weight bytes, greedy tokens) of one fresh engine."""
    with LLM("smollm2", dtype=dtype, weights=weights, compile=compile,
             enable_prefix_caching=False, num_threads=threads) as llm:
        ids = random_ids(prompt_len, llm.model_config.vocab_size, seed=1)
        llm.generate([ids[:16]], SamplingParams(max_tokens=2))  # first-call costs off the clock
        [p] = llm.prefill([ids])
        start = time.perf_counter()
        [g] = llm.generate([ids], SamplingParams(max_tokens=tokens, ignore_eos=True))
        decode_s = (time.perf_counter() - start - g.ttft_s) / (tokens - 1)
        nbytes = sum(i.weight_bytes for i in llm.rank_info())
    return prompt_len / p.ttft_s, 1 / decode_s, nbytes, g.token_ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    # 1 on a loaded machine: an OpenMP team of 2 whose threads wait for cores loses far more
    # per decode step (thousands of parallel regions) than one thread does
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--eager-too", action="store_true", help="each setting with compile=False too")
    args = ap.parse_args()
    settings = [(w, c) for w in SETTINGS for c in ((None, False) if args.eager_too else (None,))]
    if args.threads:
        torch.set_num_threads(args.threads)  # what machine() reports
    prefill, decode, nbytes, tokens = {}, {}, {}, {}
    for r in range(args.rounds):  # alternate settings, so a slow spell hits each alike
        for w in settings:
            p, d, nbytes[w], tokens[w] = one_round(*w, args.dtype, args.prompt_len, args.tokens,
                                                    args.threads)
            prefill[w], decode[w] = max(prefill.get(w, 0), p), max(decode.get(w, 0), d)
            print(f"round {r + 1} {_label(w)}: prefill {p:.0f} tok/s, decode {d:.1f} tok/s",
                  flush=True)
    rows = [[_label(w), f"{prefill[w]:.0f}", f"{decode[w]:.1f}", f"{nbytes[w] / 1e6:.0f}",
             _agreement(tokens[w], tokens[(None, None)])] for w in settings]
    print_table(f"{machine()}; SmolLM2 {args.dtype}, {args.prompt_len}-token prompt, "
                f"{args.tokens} greedy tokens, best of {args.rounds} rounds",
                ["weights", "prefill tok/s", "decode tok/s", "weight MB", "tokens vs float"], rows)


def _label(setting: tuple[str | None, bool | None]) -> str:
    weights, compile = setting
    return f"{weights}" + (", compile=False" if compile is False else "")


def _agreement(ours: list[int], theirs: list[int]) -> str:
    if ours == theirs:
        return "identical"
    first = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    return f"differ from token {first}"


if __name__ == "__main__":
    main()
