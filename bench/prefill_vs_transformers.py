"""Prefill speed of the engine next to transformers, same weights, threads and dtype, one run;
transformers runs in a process of its own (bench.baseline_process says why).

    .venv/bin/python -m bench.prefill_vs_transformers --lengths 128 512 2048 --dtype float32 --repeats 5
"""
from __future__ import annotations

import argparse

import torch

from engine import LLM
from engine.loading.checkpoint import resolve_model
from engine.observe.costs import forward_flops
from engine.observe.hardware import measure
from launcher.baseline import hf_prefill
from bench.baseline_process import BaselineProcess
from bench.common import best_of, machine, random_ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="the engine with compile=True")
    args = ap.parse_args()
    hf = BaselineProcess(str(resolve_model(args.model)), args.dtype, torch.get_num_threads())
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False,
              max_num_batched_tokens=max(args.lengths), compile=args.compile)
    peak = hf.run(matmul_peak, args.dtype)  # there: a parallel op here would slow the engine
    print(f"{machine()}; dtype={args.dtype} model={args.model} compile={args.compile}; "
          f"best of {args.repeats}, alternating; {args.dtype} matmul peak measured here "
          f"{peak / 1e9:.0f} GFLOP/s (1024² through the engine's matmul)")
    print(f"{'tokens':>6} {'engine tok/s':>12} {'GFLOP/s':>8} {'of peak':>7} {'hf tok/s':>9} "
          f"{'GFLOP/s':>8} {'ratio':>6}")
    for n in args.lengths:
        ids = random_ids(n, llm.model_config.vocab_size, seed=n)
        flops = forward_flops(llm.model_config, n, n)
        # alternate the two, so a slow spell of this shared machine hits both alike
        ours = theirs = float("inf")
        for _ in range(args.repeats):
            ours = min(ours, best_of(lambda: llm.prefill([ids]), 1))
            theirs = min(theirs, hf.run(prefill_seconds, ids))
        print(f"{n:>6} {n / ours:>12.0f} {flops / ours / 1e9:>8.1f} {flops / ours / peak:>7.0%} "
              f"{n / theirs:>9.0f} "
              f"{flops / theirs / 1e9:>8.1f} {theirs / ours:>6.2f}")
    llm.shutdown()
    hf.close()


def matmul_peak(model, dtype_name: str) -> float:
    return measure("cpu", getattr(torch, dtype_name)).peak_flops


def prefill_seconds(model, ids: list[int]) -> float:
    """transformers' side, run in its own process: one timed prefill after an untimed one."""
    return best_of(lambda: hf_prefill(model, ids), 1)


if __name__ == "__main__":
    main()
