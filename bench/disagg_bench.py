"""Disaggregated prefill: what handing a prompt's K/V to the decode engine costs, against the
decode engine recomputing the prefill itself. Both in one run, reported as a ratio.

    .venv/bin/python -m bench.disagg_bench [--lengths 512 2048] [--source-tp 2] [--dest-tp 1]

Hand-off = `decoder.decode([handle], max_tokens=1)`: checks, lease claim, block allocation, every
destination rank pulling its heads from the object store, lease settle (max_tokens=1 ends at the
first token, which came with the handle, so no decode step runs). Publish = the extra time
`prefill(export_kv=True)` takes over a plain prefill of the same cached prompt (each source rank
copying its heads of all n tokens into the object store; both recompute only the last block). Recompute = `decoder.prefill(prompt)` with its prefix cache off.
"""
from __future__ import annotations

import argparse
import statistics
import time

from bench.common import best_of, machine, random_ids
from engine import LLM, SamplingParams


def bytes_moved_per_token(decoder: LLM, itemsize: int) -> tuple[int, int]:
    """(bytes the destination ranks fetch per token, 2·layers·kv_heads·head_dim·dtype bytes).
    Each destination rank fetches exactly its KV heads' units, so the first exceeds the second
    only where the destination replicates KV heads (TP above the KV-head count)."""
    mc = decoder.model_config
    fetched_heads = sum(i.kv_heads[1] - i.kv_heads[0] for i in decoder.rank_info())
    per_head = 2 * mc.num_layers * mc.head_dim * itemsize
    return fetched_heads * per_head, mc.num_kv_heads * per_head


def one_length(prefiller: LLM, decoder: LLM, n: int, repeats: int) -> dict:
    vocab = prefiller.model_config.vocab_size
    prompts = [random_ids(n, vocab, seed=n * 100 + i) for i in range(repeats + 2)]
    once = SamplingParams(max_tokens=1)
    handoffs, publish = [], []
    for prompt in prompts[:repeats + 1]:
        prefiller.prefill([prompt])  # cached: the two timed prefills below recompute one block
        start = time.perf_counter()
        prefiller.prefill([prompt])
        plain = time.perf_counter() - start
        start = time.perf_counter()
        [out] = prefiller.prefill([prompt], export_kv=True)  # the same, plus publishing all n
        publish.append(time.perf_counter() - start - plain)
        start = time.perf_counter()
        [gen] = decoder.decode([out.kv], once)
        handoffs.append(time.perf_counter() - start)
        assert gen.token_ids == [out.first_token]
    with decoder.prefix_caching(False):
        recompute = best_of(lambda: decoder.prefill([prompts[-1]]), 2)
    handoff = min(handoffs[1:])  # the first is a warm-up
    return {"tokens": n, "handoff_s": handoff, "publish_s": statistics.median(publish[1:]),
            "recompute_s": recompute, "ratio": handoff / recompute}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--source-tp", type=int, default=2)
    ap.add_argument("--dest-tp", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    settings = dict(max_model_len=max(args.lengths) + 16, kv_cache_gb=0.4, cpus_per_rank=0.5)
    with LLM(args.model, tp=args.source_tp, **settings) as prefiller, \
            LLM(args.model, tp=args.dest_tp, **settings) as decoder:
        moved, formula = bytes_moved_per_token(decoder, decoder.plan.dtype.itemsize)
        print(f"# {machine()}; source tp={args.source_tp}, destination tp={args.dest_tp}, "
              f"{args.model}, {decoder.plan.dtype}")
        print(f"bytes moved per token: {moved} (2·layers·kv_heads·head_dim·dtype = {formula})")
        print("| prompt tokens | hand-off ms | publish ms (median) | recompute prefill ms | hand-off / recompute |")
        print("|---:|---:|---:|---:|---:|")
        for n in args.lengths:
            r = one_length(prefiller, decoder, n, args.repeats)
            print(f"| {n} | {r['handoff_s'] * 1e3:.1f} | {r['publish_s'] * 1e3:.1f} | "
                  f"{r['recompute_s'] * 1e3:.0f} | {r['ratio']:.3f} |")


if __name__ == "__main__":
    main()
