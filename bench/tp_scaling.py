"""Prefill and decode at TP=1 and TP=2 on Ray rank actors, each TP > 1 run with its all-reduce
through shared memory and through gloo, side by side, with where each step's time went: inside
all-reduce/gather, and outside the forward (scheduling, transfer, return).

    .venv/bin/python -m bench.tp_scaling --lengths 512 2048 --tp 1 2
    .venv/bin/python -m bench.tp_scaling --lengths 256 --tp 1 2 --dtype bfloat16 --weights gguf

Decode: the tokens after the first of a greedy generation of --decode-tokens + 1 after the
prompt, timed within the call (its time less the first token's); its all-reduce share is rank
0's time in collectives over those steps' wall time.
"""
from __future__ import annotations

import argparse
import time

from bench.common import machine, random_ids
from engine import LLM, SamplingParams


def measure(model: str, tp: int, length: int, repeats: int, dtype: str, weights: str | None,
            shared: bool, decode_tokens: int) -> dict:
    settings = {"weights": weights} if weights else {}
    with LLM(model, tp=tp, executor="ray", dtype=dtype, enable_prefix_caching=False,
             max_num_batched_tokens=length, num_threads=1, shared_memory_all_reduce=shared,
             **settings) as llm:
        ids = random_ids(length, llm.model_config.vocab_size, seed=length)
        llm.prefill([ids])  # warm-up
        prompts = []
        for _ in range(repeats):
            llm.prefill([ids])
            prompts.append(llm.step_timings()[-1])
        best = min(prompts, key=lambda s: s.wall_s)
        decode = best_decode(llm, ids, repeats, decode_tokens)
        kind = llm.rank_info()[0].all_reduce
    return {"tp": tp, "tokens": length, "tok_s": length / best.wall_s, "wall_ms": best.wall_s * 1e3,
            "collective_share": best.collective_s / best.wall_s,
            "overhead_share": best.overhead_s / best.wall_s, "all_reduce": kind, **decode}


def best_decode(llm: LLM, ids: list[int], repeats: int, tokens: int) -> dict:
    """The fastest of `repeats` greedy generations' decode rate, and its all-reduce share."""
    params = SamplingParams(max_tokens=tokens + 1, ignore_eos=True)
    best = None
    for _ in range(repeats):
        started = time.perf_counter()
        [out] = llm.generate([ids], params)
        seconds = time.perf_counter() - started - out.ttft_s
        steps = llm.step_timings()[-tokens:]
        share = sum(s.collective_s for s in steps) / sum(s.wall_s for s in steps)
        if best is None or seconds < best[0]:
            best = (seconds, share)
    return {"decode_tok_s": tokens / best[0], "decode_collective_share": best[1]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--weights", default=None, help="int8 | int4 | gguf (default: the model's)")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--all-reduce", nargs="+", default=["shared", "gloo"],
                    choices=["shared", "gloo"], help="the ways TP > 1 runs sum (default both)")
    args = ap.parse_args()
    print(f"{machine()}; model={args.model} dtype={args.dtype} weights={args.weights}; one "
          f"torch thread per rank actor")
    print(f"{'tp':>3} {'all-reduce':>10} {'tokens':>6} {'tok/s':>7} {'step ms':>8} "
          f"{'in coll.':>8} {'driver':>7} {'speedup':>7} {'decode':>7} {'in coll.':>8}")
    base = {}
    for length in args.lengths:
        for tp in args.tp:
            for way in (args.all_reduce if tp > 1 else ["-"]):
                r = measure(args.model, tp, length, args.repeats, args.dtype, args.weights,
                            way != "gloo", args.decode_tokens)
                base.setdefault(length, r["tok_s"])
                print(f"{tp:>3} {way:>10} {length:>6} {r['tok_s']:>7.0f} {r['wall_ms']:>8.0f} "
                      f"{r['collective_share']:>8.1%} {r['overhead_share']:>7.1%} "
                      f"{r['tok_s'] / base[length]:>7.2f} {r['decode_tok_s']:>7.1f} "
                      f"{r['decode_collective_share']:>8.1%}", flush=True)


if __name__ == "__main__":
    main()
