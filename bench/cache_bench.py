"""What the paged cache buys: prefix hits, batching, chunked prefill. Each comparison is made
in one run, side by side, and reported as a ratio.

    .venv/bin/python -m bench.cache_bench
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

from bench.common import best_of, machine, random_ids
from engine import LLM, SamplingParams


def prefix_hit(llm: LLM, vocab: int) -> str:
    """TTFT of a 2048-token prompt whose first 1792 tokens are cached, against it uncached."""
    shared = random_ids(1792, vocab, seed=1)
    llm.prefill([shared + random_ids(256, vocab, seed=2)])  # fills the prefix cache
    fresh = [shared + random_ids(256, vocab, seed=s) for s in range(10, 14)]
    hit = best_of(lambda: llm.prefill([fresh.pop()]), 3)  # 1 untimed + 3 timed, each a new tail
    cold_prompts = [random_ids(2048, vocab, seed=s) for s in (98, 99)]  # nothing shared
    cold = best_of(lambda: llm.prefill([cold_prompts.pop()]), 1)
    return f"2048-token prompt, 1792 cached: TTFT {hit * 1e3:.0f} ms vs {cold * 1e3:.0f} ms uncached = {hit / cold:.2f}x"


def batching(model: str, dtype: str, vocab: int) -> str:
    prompts = [random_ids(n, vocab, seed=n) for n in (64, 96, 128, 160, 192, 224, 256, 288)]
    tokens = sum(map(len, prompts))
    with LLM(model, dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=4096) as llm:
        together = best_of(lambda: llm.prefill(prompts), 2)
        apart = best_of(lambda: [llm.prefill([p]) for p in prompts], 2)
    return (f"8 prompts ({tokens} tokens): one batch {tokens / together:.0f} tok/s vs 8 prefills "
            f"{tokens / apart:.0f} tok/s = {apart / together:.2f}x")


def short_behind_long(model: str, dtype: str, vocab: int) -> str:
    """TTFT of a short prompt submitted right behind a 4096-token one."""
    long, short = random_ids(4096, vocab, seed=4), random_ids(16, vocab, seed=5)
    ttft = {}
    for budget in (4096, 512):
        with LLM(model, dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=budget) as llm:
            llm.prefill([short])  # warm-up
            ttft[budget] = llm.generate([long, short], SamplingParams(max_tokens=1))[1].ttft_s
    return (f"16-token prompt behind a 4096-token one: TTFT {ttft[512] * 1e3:.0f} ms with 512-token "
            f"chunks vs {ttft[4096] * 1e3:.0f} ms unchunked = {ttft[512] / ttft[4096]:.2f}x")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_child(model: str, dtype: str, budget: int, length: int) -> None:
    """Resident memory sampled every millisecond during one long prefill, above where it started
    (the process-wide high-water mark would be set by model loading, not by the prefill)."""
    with LLM(model, dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=budget) as llm:
        llm.prefill([random_ids(16, 49152, seed=1)])
        before, peak, done = _rss_bytes(), [0], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], _rss_bytes())
                time.sleep(0.001)

        sampler = threading.Thread(target=sample)
        sampler.start()
        llm.prefill([random_ids(length, llm.model_config.vocab_size, seed=6)])
        done.set()
        sampler.join()
    print(json.dumps({"peak_growth_mb": (peak[0] - before) / 2**20}))


def peak_memory(model: str, dtype: str, length: int = 4096) -> str:
    """Growth of resident memory during one long prefill, each configuration in a fresh process."""
    growth = {}
    for budget in (length, 512):
        out = subprocess.run([sys.executable, "-m", "bench.cache_bench", "--peak-child",
                              str(budget), "--model", model, "--dtype", dtype],
                             capture_output=True, text=True, check=True).stdout
        growth[budget] = json.loads(out.strip().splitlines()[-1])["peak_growth_mb"]
    return (f"{length}-token prefill peak memory growth: {growth[512]:.0f} MB in 512-token chunks vs "
            f"{growth[length]:.0f} MB in one pass = {growth[512] / growth[length]:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--peak-child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peak_child:
        return _peak_rss_child(args.model, args.dtype, args.peak_child, 4096)
    print(f"{machine()}; model={args.model} dtype={args.dtype}")
    with LLM(args.model, dtype=args.dtype, max_num_batched_tokens=4096) as llm:
        vocab = llm.model_config.vocab_size
        print(prefix_hit(llm, vocab))
    print(batching(args.model, args.dtype, vocab))
    print(short_behind_long(args.model, args.dtype, vocab))
    print(peak_memory(args.model, args.dtype))


if __name__ == "__main__":
    main()
