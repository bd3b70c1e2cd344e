"""Load an OpenAI-compatible server with real prompts and measure what its users feel: request
throughput, TTFT and inter-token latency (p50/p90/p99), with a plot.

    .venv/bin/python -m bench.serve_bench                       # starts launcher.serve itself
    .venv/bin/python -m bench.serve_bench --requests 64 --concurrency 4 --max-tokens 16
    .venv/bin/python -m bench.serve_bench --rate 2.0            # Poisson arrivals, 2 requests/s
    .venv/bin/python -m bench.serve_bench --url http://127.0.0.1:8000/v1 --model NAME  # any server

Prompts are the shipped document (launcher/data/prefill_explained.txt) cut to mixed lengths,
in groups sharing a prefix (a long passage, then a different short passage per request), as
requests that quote one document do. Every request streams (`stream_options.include_usage`), so
TTFT is the first chunk's arrival and ITL the gaps between chunks, measured by the client. The
run is bounded in count (--requests) and time (--max-seconds: requests still out then are
cancelled and counted as failed). Only loopback URLs are accepted: this is a local benchmark.
After a run against the server it started, the bench reads /metrics and fails if any KV block
is still in use or any request still running.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

DOCUMENT = Path(__file__).resolve().parent.parent / "launcher" / "data" / "prefill_explained.txt"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass(slots=True)
class RequestResult:
    prompt_chars: int
    ok: bool = False
    error: str = ""
    ttft_s: float = float("nan")
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = float("nan")
    completion_tokens: int = 0


def prompts(n: int, lengths: list[int], group_size: int, seed: int) -> list[str]:
    """n prompts of the document: groups of `group_size` share a passage of one of `lengths`
    characters, each followed by its own 200-character passage."""
    text = DOCUMENT.read_text(encoding="utf-8")
    rng, out = random.Random(seed), []
    while len(out) < n:
        size = rng.choice(lengths)
        start = rng.randrange(0, max(1, len(text) - size))
        shared = text[start:start + size]
        for _ in range(min(group_size, n - len(out))):
            q = rng.randrange(0, len(text) - 200)
            out.append(f"{shared}\n\nAbout this passage: {text[q:q + 200]}\n\nIn short,")
    rng.shuffle(out)
    return out


async def one_request(client, model: str, prompt: str, max_tokens: int,
                      ignore_eos: bool) -> RequestResult:
    r = RequestResult(len(prompt))
    start = last = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True} if ignore_eos else None)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                r.completion_tokens = chunk.usage.completion_tokens
            if not chunk.choices or chunk.choices[0].finish_reason is not None:
                continue
            if r.ttft_s != r.ttft_s:  # nan: the first token
                r.ttft_s = now - start
            else:
                r.itl_s.append(now - last)
            last = now
        r.e2e_s, r.ok = time.perf_counter() - start, True
    except Exception as e:  # noqa: BLE001  counted and reported, the run goes on
        r.error = f"{type(e).__name__}: {e}"[:300]
    return r


async def run_load(base_url: str, model: str, texts: list[str], concurrency: int, rate: float,
                   max_tokens: int, max_seconds: float, ignore_eos: bool = True,
                   api_key: str = "none", seed: int = 0) -> tuple[list[RequestResult], float]:
    """Send every prompt, at most `concurrency` at once, arriving as a Poisson process of
    `rate` per second (0: as fast as the concurrency allows). Returns results and wall time."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                timeout=max_seconds)
    slots, rng = asyncio.Semaphore(concurrency), random.Random(seed)

    async def limited(prompt: str) -> RequestResult:
        async with slots:
            return await one_request(client, model, prompt, max_tokens, ignore_eos)

    start, tasks = time.perf_counter(), []
    try:
        async with asyncio.timeout(max_seconds):
            for prompt in texts:
                tasks.append(asyncio.ensure_future(limited(prompt)))
                if rate > 0:
                    await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)
    except TimeoutError:
        for t in tasks:
            t.cancel()
    results = [t.result() if t.done() and not t.cancelled() else
               RequestResult(len(p), error=f"not done within --max-seconds={max_seconds}")
               for t, p in zip(tasks, texts)]
    results += [RequestResult(len(p), error="never sent: --max-seconds passed")
                for p in texts[len(tasks):]]
    await client.close()
    return results, time.perf_counter() - start


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s == r.ttft_s]
    itl = [x for r in ok for x in r.itl_s]
    return {"requests": len(results), "failed": len(results) - len(ok), "wall_s": wall_s,
            "requests_per_s": len(ok) / wall_s,
            "output_tokens_per_s": sum(r.completion_tokens for r in ok) / wall_s,
            **_percentiles("ttft", ttft), **_percentiles("itl", itl),
            **_percentiles("e2e", [r.e2e_s for r in ok]),
            "errors": sorted({r.error for r in results if r.error})[:5]}


def _percentiles(name: str, xs: list[float]) -> dict:
    if len(xs) < 2:
        return {f"{name}_p{p}_s": (xs[0] if xs else float("nan")) for p in (50, 90, 99)}
    q = statistics.quantiles(xs, n=100, method="inclusive")
    return {f"{name}_p50_s": q[49], f"{name}_p90_s": q[89], f"{name}_p99_s": q[98]}


def plot(results: list[RequestResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (name, xs) in zip(axes, [("TTFT", [r.ttft_s for r in ok]),
                                     ("inter-token latency", [x for r in ok for x in r.itl_s])]):
        xs = sorted(x * 1e3 for x in xs if x == x)
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], drawstyle="steps-post")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def start_local_server(port: int, overrides: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher.serve", f"serve.port={port}",
                             "serve.log_level=warning", *overrides], start_new_session=True)


def wait_healthy(root: str, proc: subprocess.Popen | None, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    # one client: each httpx.get would build a TLS context (~24 ms of CPU) the starting server
    # could use
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode}")
            try:
                if client.get(f"{root}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
    raise SystemExit(f"{root}/health did not answer 200 within {timeout} s")


def leaks(root: str) -> list[str]:
    """KV blocks still in use or requests still running, from the server's /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{root}/metrics", timeout=30).text
    return [f"{s.name}{s.labels} = {s.value}" for f in text_string_to_metric_families(text)
            for s in f.samples if s.name in ("prefill:kv_blocks_used", "vllm:num_requests_running",
                                             "vllm:num_requests_waiting") and s.value]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="an OpenAI-compatible base URL (…/v1) on this machine; "
                    "default: start `python -m launcher.serve` on a free port")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second; 0: "
                    "closed loop at --concurrency")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lengths", default="300,1200,3000", help="shared-passage lengths, chars")
    ap.add_argument("--group-size", type=int, default=4, help="requests sharing one passage")
    ap.add_argument("--max-seconds", type=float, default=900)
    ap.add_argument("--no-ignore-eos", action="store_true", help="for servers without vLLM's "
                    "ignore_eos extension (requests may then stop early)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="serve_bench.jsonl")
    ap.add_argument("--plot", default="bench_plots/serve_bench.png")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for the server it starts")
    args = ap.parse_args()

    proc = None
    if args.url is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = start_local_server(port, args.overrides)
        args.url = f"http://127.0.0.1:{port}/v1"
    host = urlparse(args.url).hostname
    if host not in LOOPBACK:
        raise SystemExit(f"--url host {host!r} is not this machine; use 127.0.0.1")
    root = args.url.rsplit("/v1", 1)[0]
    try:
        wait_healthy(root, proc)
        texts = prompts(args.requests, [int(x) for x in args.lengths.split(",")],
                        args.group_size, args.seed)
        results, wall = asyncio.run(run_load(
            args.url, args.model, texts, args.concurrency, args.rate, args.max_tokens,
            args.max_seconds, not args.no_ignore_eos, seed=args.seed))
        summary = {"url": args.url, "model": args.model, "concurrency": args.concurrency,
                   "rate": args.rate, "max_tokens": args.max_tokens, **summarize(results, wall)}
        if proc is not None:
            summary["leaks"] = leaks(root)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=120)
    with open(args.out, "a", encoding="utf-8") as f:
        f.write(json.dumps(summary) + "\n")
    plot(results, Path(args.plot), f"{args.model}: {args.requests} requests, "
         f"{args.concurrency} concurrent" + (f", {args.rate}/s" if args.rate else ""))
    print(json.dumps(summary, indent=1))
    if summary["failed"] or summary.get("leaks"):
        sys.exit(1)


if __name__ == "__main__":
    main()
