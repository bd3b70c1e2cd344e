"""Prefill throughput at TP=1 and TP=2 on Ray rank actors, with where each step's time went:
inside all-reduce/gather, and outside the forward (scheduling, transfer, return).

    .venv/bin/python -m bench.tp_scaling --lengths 512 2048 --tp 1 2
"""
from __future__ import annotations

import argparse

from bench.common import machine, random_ids
from engine import LLM


def measure(model: str, tp: int, length: int, repeats: int, dtype: str) -> dict:
    with LLM(model, tp=tp, executor="ray", dtype=dtype, enable_prefix_caching=False,
             max_num_batched_tokens=length, num_threads=1) as llm:
        ids = random_ids(length, llm.model_config.vocab_size, seed=length)
        llm.prefill([ids])  # warm-up
        runs = []
        for _ in range(repeats):
            llm.prefill([ids])
            runs.append(llm.step_timings()[-1])
        best = min(runs, key=lambda s: s.wall_s)
    return {"tp": tp, "tokens": length, "tok_s": length / best.wall_s, "wall_ms": best.wall_s * 1e3,
            "collective_share": best.collective_s / best.wall_s,
            "overhead_share": best.overhead_s / best.wall_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    print(f"{machine()}; model={args.model} dtype={args.dtype}; one torch thread per rank actor")
    print(f"{'tp':>3} {'tokens':>6} {'tok/s':>7} {'step ms':>8} {'all-reduce':>10} {'driver':>7} {'speedup':>7}")
    base = {}
    for length in args.lengths:
        for tp in args.tp:
            r = measure(args.model, tp, length, args.repeats, args.dtype)
            base.setdefault(length, r["tok_s"])
            print(f"{tp:>3} {length:>6} {r['tok_s']:>7.0f} {r['wall_ms']:>8.0f} "
                  f"{r['collective_share']:>10.1%} {r['overhead_share']:>7.1%} "
                  f"{r['tok_s'] / base[length]:>7.2f}")


if __name__ == "__main__":
    main()
