"""Disaggregated against colocated serving on the same number of ranks: the inter-token latency
(ITL) of requests that are decoding while long prompts arrive, and the long prompts' TTFT.

    .venv/bin/python -m bench.disagg_itl [--colocated dp|tp] [--long-len 1024] [--longs 4]

Workload, the same for both: `--shorts` short prompts start decoding; once each has its first
token, `--longs` long prompts arrive `--gap` seconds apart; the short requests stop when the last
long one is done. Each short request's token arrival times come from `LLM.stream`; its ITLs are
the gaps between them (its first token excluded).

- colocated: one engine of two ranks (`dp=2`, tp=1 each, or `tp=2`) serves everything, with
  chunked prefill as configured by default, so a long prompt shares steps with the decodes.
- disaggregated: a prefill engine (tp=1) and a decode engine (tp=1), each rank in its own Ray
  actor like the colocated ones; short requests run on the decode engine, long ones go through
  launcher.disagg's router (prefill with export_kv, then decode of the handle).
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import statistics
import sys
import time
from dataclasses import dataclass, field

from bench.common import machine, random_ids
from engine import LLM, SamplingParams
from launcher.disagg import route

SHORT_MAX_TOKENS = 2048


@dataclass
class Workload:
    shorts: int
    short_len: int
    longs: int
    long_len: int
    gap_s: float
    long_params: SamplingParams
    # short requests decode until told to stop (max_tokens only bounds a run gone wrong)
    short_params: SamplingParams = field(
        default_factory=lambda: SamplingParams(max_tokens=SHORT_MAX_TOKENS, ignore_eos=True))

    def prompts(self, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
        """The same random prompts for every run; none shares a prefix with another."""
        return ([random_ids(self.short_len, vocab, seed=100 + i) for i in range(self.shorts)],
                [random_ids(self.long_len, vocab, seed=200 + i) for i in range(self.longs)])


@dataclass
class Result:
    itl_s: list[float] = field(default_factory=list)  # every short request's token gaps
    short_ttft_s: list[float] = field(default_factory=list)
    long_ttft_s: list[float] = field(default_factory=list)


async def _decode_short(llm: LLM, prompt: list[int], params: SamplingParams, started: list,
                        stop: asyncio.Event, result: Result) -> None:
    begin, times = time.perf_counter(), []
    tokens = llm.stream(prompt, params)
    try:
        async for _ in tokens:
            times.append(time.perf_counter())
            if len(times) == 1:
                started.append(1)
            if stop.is_set():
                break
    finally:
        await tokens.aclose()  # cancels the request if it is still running
    result.short_ttft_s.append(times[0] - begin)
    result.itl_s += [b - a for a, b in zip(times, times[1:])]


async def _run(work: Workload, short_engine: LLM, serve_long) -> Result:
    """Shorts on `short_engine`; `serve_long(prompt, arrive_at)` (blocking) returns a TTFT."""
    result, stop, started = Result(), asyncio.Event(), []
    short_prompts, long_prompts = work.prompts(short_engine.model_config.vocab_size)
    shorts = [asyncio.create_task(_decode_short(short_engine, p, work.short_params, started, stop,
                                                result)) for p in short_prompts]
    while len(started) < len(shorts):  # every short request is decoding before a long arrives
        await asyncio.sleep(0.01)
    t0, loop = time.perf_counter(), asyncio.get_running_loop()
    with concurrent.futures.ThreadPoolExecutor(len(long_prompts)) as pool:  # one thread each
        longs = [loop.run_in_executor(pool, serve_long, p, t0 + i * work.gap_s)
                 for i, p in enumerate(long_prompts)]
        result.long_ttft_s = list(await asyncio.gather(*longs))
    stop.set()
    await asyncio.gather(*shorts)
    return result


def _colocated_long(llm: LLM, params: SamplingParams):
    def serve(prompt: list[int], arrive_at: float) -> float:
        time.sleep(max(0.0, arrive_at - time.perf_counter()))
        return llm.generate([prompt], params)[0].ttft_s
    return serve


def colocated(model: str, layout: str, work: Workload, settings: dict) -> Result:
    shape = dict(dp=2) if layout == "dp" else dict(tp=2)
    with LLM(model, **shape, **settings) as llm:
        _warm_up(llm, work.long_len)
        return asyncio.run(_run(work, llm, _colocated_long(llm, work.long_params)))


def disaggregated(model: str, work: Workload, settings: dict) -> Result:
    settings = dict(settings, executor="ray")  # each rank in its own process, as colocated
    with LLM(model, **settings) as pre, LLM(model, **settings) as dec:
        _warm_up(pre, work.long_len)
        _warm_up(dec, work.long_len)
        route(pre, dec, random_ids(work.long_len, pre.model_config.vocab_size, seed=7),
              work.long_params, 0.0)  # a first hand-off

        def serve(prompt: list[int], arrive_at: float) -> float:
            return route(pre, dec, prompt, work.long_params, arrive_at)["ttft_s"]
        return asyncio.run(_run(work, dec, serve))


def _warm_up(llm: LLM, n: int) -> None:
    """One long prefill and a few decode steps on every replica (prompts the run never uses)."""
    vocab = llm.model_config.vocab_size
    llm.generate([random_ids(n, vocab, seed=i) for i in range(len(llm.rank_pids()))],
                 SamplingParams(max_tokens=4, ignore_eos=True))


def _pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def _row(name: str, r: Result) -> dict:
    return {"name": name, "itl_p50": _pct(r.itl_s, 50), "itl_p99": _pct(r.itl_s, 99),
            "itl_max": max(r.itl_s), "samples": len(r.itl_s),
            "long_ttft_p50": statistics.median(r.long_ttft_s),
            "short_ttft_p50": statistics.median(r.short_ttft_s)}


def report(rows: list[dict]) -> None:
    print("| serving | ITL p50 ms | ITL p99 ms | ITL max ms | ITL samples | long TTFT p50 ms "
          "| short TTFT p50 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['name']} | {r['itl_p50'] * 1e3:.1f} | {r['itl_p99'] * 1e3:.1f} | "
              f"{r['itl_max'] * 1e3:.0f} | {r['samples']} | {r['long_ttft_p50'] * 1e3:.0f} | "
              f"{r['short_ttft_p50'] * 1e3:.0f} |")
    col, dis = rows
    print(f"disaggregated / colocated: ITL p50 {dis['itl_p50'] / col['itl_p50']:.2f}x, "
          f"ITL p99 {dis['itl_p99'] / col['itl_p99']:.2f}x (goal <= 0.5x), "
          f"long TTFT p50 {dis['long_ttft_p50'] / col['long_ttft_p50']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--colocated", choices=("dp", "tp"), default="dp",
                    help="the colocated engine's two ranks: dp=2 (tp=1 each) or tp=2")
    ap.add_argument("--shorts", type=int, default=4)
    ap.add_argument("--short-len", type=int, default=32)
    ap.add_argument("--longs", type=int, default=3)
    ap.add_argument("--long-len", type=int, default=1024)
    ap.add_argument("--long-max-tokens", type=int, default=4)
    ap.add_argument("--gap", type=float, default=3.0, help="seconds between long arrivals")
    args = ap.parse_args()
    for name in ("shorts", "short_len", "longs", "long_len", "long_max_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.gap < 0:
        ap.error("--gap must be >= 0")
    work = Workload(args.shorts, args.short_len, args.longs, args.long_len, args.gap,
                    SamplingParams(max_tokens=args.long_max_tokens, ignore_eos=True))
    settings = dict(max_model_len=max(args.short_len + SHORT_MAX_TOKENS,
                                      args.long_len + args.long_max_tokens), kv_cache_gb=0.5)
    print(f"# {machine()}")
    print(f"# {' '.join(['python -m bench.disagg_itl', *sys.argv[1:]])}")
    layout = "dp=2 tp=1" if args.colocated == "dp" else "tp=2"
    rows = [_row(f"colocated ({layout})", colocated(args.model, args.colocated, work, settings)),
            _row("disaggregated (prefill tp=1 + decode tp=1)",
                 disaggregated(args.model, work, settings))]
    report(rows)


if __name__ == "__main__":
    main()
