"""Prefix-affinity against least-loaded routing with dp=2 on a shared-prefix workload: prefix-cache
hit rate and TTFT, both routings in one run.

    .venv/bin/python -m bench.routing_bench [--groups 4] [--per-group 4] [--prefix-len 512]

Workload: `--groups` shared prefixes (a system prompt, a document) of `--prefix-len` random
tokens, each followed by `--per-group` different `--suffix-len`-token questions; the requests
come in a seeded random order, in waves of `--wave` sent together (one `prefill` call), so the
replicas are busy when a request is routed. The hit rate is the engine's own counter
(`cache_stats()`: prompt tokens served from the prefix cache / prompt tokens looked up, both
replicas, measured requests only); TTFT is each request's, from the same outputs.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys

from bench.common import machine, random_ids
from engine import LLM


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    prefixes = [random_ids(args.prefix_len, vocab, seed=1000 + g) for g in range(args.groups)]
    prompts = [prefix + random_ids(args.suffix_len, vocab, seed=2000 + g * args.per_group + i)
               for g, prefix in enumerate(prefixes) for i in range(args.per_group)]
    random.Random(args.seed).shuffle(prompts)
    return prompts


def _hits(llm: LLM) -> tuple[int, int]:
    replicas = llm.cache_stats()["replicas"]
    return (sum(r["prefix_hit_tokens"] for r in replicas),
            sum(r["prefix_lookup_tokens"] for r in replicas))


def run(args: argparse.Namespace, routing: str) -> dict:
    with LLM(args.model, dp=2, routing=routing, max_model_len=args.prefix_len + args.suffix_len + 1,
             kv_cache_gb=args.kv_cache_gb) as llm:
        vocab = llm.model_config.vocab_size
        llm.prefill([random_ids(args.suffix_len, vocab, seed=i) for i in range(2)])  # warm-up
        prompts = workload(args, vocab)
        hit0, looked0 = _hits(llm)
        ttfts = []
        for start in range(0, len(prompts), args.wave):
            ttfts += [o.ttft_s for o in llm.prefill(prompts[start:start + args.wave])]
        hit, looked = _hits(llm)
    return {"routing": routing, "hit_rate": (hit - hit0) / (looked - looked0),
            "ttft_p50": statistics.median(ttfts), "ttft_mean": statistics.fmean(ttfts),
            "ttft_max": max(ttfts)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--per-group", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--wave", type=int, default=4, help="requests sent together")
    ap.add_argument("--kv-cache-gb", type=float, default=0.5, help="per rank")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for name in ("groups", "per_group", "prefix_len", "suffix_len", "wave"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    print(f"# {machine()}")
    print(f"# {' '.join(['python -m bench.routing_bench', *sys.argv[1:]])}")
    rows = [run(args, "prefix_affinity"), run(args, "least_loaded")]
    print("| routing (dp=2) | prefix-cache hit rate | TTFT p50 ms | TTFT mean ms | TTFT max ms |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['routing']} | {r['hit_rate']:.1%} | {r['ttft_p50'] * 1e3:.0f} | "
              f"{r['ttft_mean'] * 1e3:.0f} | {r['ttft_max'] * 1e3:.0f} |")
    aff, least = rows
    hits = aff["hit_rate"] / max(least["hit_rate"], 1e-9)
    print(f"prefix_affinity / least_loaded: hit rate {hits:.2f}x, "
          f"TTFT p50 {aff['ttft_p50'] / least['ttft_p50']:.2f}x, "
          f"TTFT mean {aff['ttft_mean'] / least['ttft_mean']:.2f}x")


if __name__ == "__main__":
    main()
