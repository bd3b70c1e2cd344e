"""Scaling one prefill: (1) the exposed all-reduce share at TP=2 with overlap_comm off and on;
(2) CP=2 against TP=2 and one rank: tokens/s, bytes each rank sent per layer (the formula
beside the measurement), peak memory per rank.

    .venv/bin/python -m bench.scaling_bench overlap --lengths 1024 4096
    .venv/bin/python -m bench.scaling_bench cp --lengths 4096 8192

Bytes are measured as what each rank process wrote to its sockets during the step
(/proc/PID/io wchar: gloo sends with writev, which it counts). Numbers mean something only on
an otherwise idle machine: ratios within one run, never absolute times.
"""
from __future__ import annotations

import argparse
import os

from bench.common import machine, random_ids
from engine import LLM


def _proc(pid: int, name: str, key: str) -> int:
    with open(f"/proc/{pid}/{name}") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    return 0


def _wchar(pids: list[int]) -> list[int]:
    return [_proc(pid, "io", "wchar:") for pid in pids]


def _peak_mib(pids: list[int]) -> list[float]:
    return [_proc(pid, "status", "VmHWM:") / 1024 for pid in pids]  # kB -> MiB


def measure(model: str, length: int, repeats: int, **settings) -> dict:
    in_process = settings.get("tp", 1) * settings.get("cp", 1) == 1
    if in_process:  # this process is the rank: restart its peak-memory mark
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    # whole prompts in one step (cp > 1 needs the budget to hold max_model_len)
    with LLM(model, dtype="float32", enable_prefix_caching=False, max_model_len=length + 8,
             max_num_batched_tokens=length + 8, kv_cache_gb=0.5, step_timeout_s=900.0,
             **settings) as llm:
        pids = [os.getpid()] if in_process else llm.rank_pids()[0]
        ids = random_ids(length, llm.model_config.vocab_size, seed=length)
        llm.prefill([random_ids(64, llm.model_config.vocab_size, seed=1)])  # warm-up
        runs = []
        for _ in range(repeats):
            before = _wchar(pids)
            llm.prefill([ids])
            runs.append((llm.step_timings()[-1], [b - a for a, b in zip(before, _wchar(pids))]))
        best, sent = min(runs, key=lambda r: r[0].wall_s)
        layers = llm.model_config.num_layers
        return {"tok_s": length / best.wall_s, "wall_s": best.wall_s,
                "exposed": best.comm_exposed_s / best.wall_s,
                "total": best.comm_total_s / best.wall_s,
                "sent_per_layer": [s / layers for s in sent], "peak_mib": _peak_mib(pids),
                "config": llm.model_config}


def formula_per_layer(cfg, length: int, tp: int, cp: int) -> float:
    """Bytes one rank sends per layer (fp32): two ring all-reduces of its tokens' hidden states
    (2(tp-1)/tp of the payload each) and cp-1 ring passes of its K/V chunk (padded to the
    largest rank's share, as the ring sends it). Once-per-step traffic (embedding all-reduce,
    logits) is left out."""
    b, tokens = 4, -(-length // cp)
    all_reduce = 2 * 2 * (tp - 1) / tp * tokens * cfg.hidden_size * b if tp > 1 else 0.0
    kv_heads = -(-cfg.num_kv_heads // tp)  # the widest rank's heads
    ring = (cp - 1) * tokens * 2 * kv_heads * cfg.head_dim * b
    return all_reduce + ring


def overlap(args) -> None:
    print("| tokens | layout | tok/s | vs one rank | exposed comm | total comm |")
    print("|---|---|---|---|---|---|")
    for length in args.lengths:
        one = measure(args.model, length, args.repeats, num_threads=2)
        print(f"| {length} | one rank, 2 threads | {one['tok_s']:.0f} | 1.00 | - | - |")
        for on in (False, True):
            r = measure(args.model, length, args.repeats, tp=2, overlap_comm=on)
            print(f"| {length} | TP=2, overlap_comm={on} | {r['tok_s']:.0f} | "
                  f"{r['tok_s'] / one['tok_s']:.2f} | {r['exposed']:.1%} | {r['total']:.1%} |")


def context(args) -> None:
    print("| tokens | layout | tok/s | vs one rank | sent/layer/rank MB measured (formula) "
          "| peak MiB per rank | exposed comm |")
    print("|---|---|---|---|---|---|---|")
    for length in args.lengths:
        one = measure(args.model, length, args.repeats, num_threads=2)
        print(f"| {length} | one rank, 2 threads | {one['tok_s']:.0f} | 1.00 | - | "
              f"{one['peak_mib'][0]:.0f} | - |")
        for tp, cp in ((2, 1), (1, 2)):
            r = measure(args.model, length, args.repeats, tp=tp, cp=cp, executor="ray")
            sent = " / ".join(f"{s / 1e6:.1f}" for s in r["sent_per_layer"])
            want = formula_per_layer(r["config"], length, tp, cp) / 1e6
            peak = " / ".join(f"{p:.0f}" for p in r["peak_mib"])
            print(f"| {length} | TP={tp} x CP={cp} | {r['tok_s']:.0f} | "
                  f"{r['tok_s'] / one['tok_s']:.2f} | {sent} ({want:.1f}) | {peak} | "
                  f"{r['exposed']:.1%} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["overlap", "cp"])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    print(f"{machine()}; model={args.model} float32; rank actors run one torch thread each")
    (overlap if args.what == "overlap" else context)(args)


if __name__ == "__main__":
    main()
