"""Disaggregated serving: a prefill group, a decode group, and a router between them.

Requests arrive (Poisson, `arrival_rate` per second) with random `prompt_len`-token prompts; the
router prefills each on the prefill group with `export_kv=True` and hands its KVHandle to the
decode group. Every request runs on its own thread; both engines' step loops batch whatever is
in flight. Reports per-request TTFT (prefill), hand-off + decode time, and the totals.
"""
from __future__ import annotations

import launcher  # noqa: F401  first: run by its path, it relaunches preloaded before torch loads

import concurrent.futures
import random
import statistics
import time

from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from engine import LLM, SamplingParams
from engine.loading.synthetic import random_token_ids
from launcher.hydra_main import hydra_app, integer, number
from launcher.build_engine import engine_settings


def _engine(cfg: DictConfig, group: DictConfig) -> LLM:
    settings = engine_settings(cfg)
    settings.update(tp=group.tp, dp=group.dp)
    return LLM(cfg.model.path, **settings)


def route(prefiller: LLM, decoder: LLM, prompt: list[int], params: SamplingParams,
          arrive_at: float) -> dict:
    """One request at `arrive_at` (perf_counter): prefill it, hand its KVHandle to the decoder.
    TTFT is the prefill's (its first token comes back with the handle)."""
    time.sleep(max(0.0, arrive_at - time.perf_counter()))
    start = time.perf_counter()
    [out] = prefiller.prefill([prompt], params, export_kv=True)
    handed = time.perf_counter()
    [gen] = decoder.decode([out.kv], params)
    end = time.perf_counter()
    return {"ttft_s": handed - start, "decode_s": end - handed, "latency_s": end - start,
            "tokens": len(gen.token_ids)}


def check(cfg: DictConfig) -> None:
    """The app's own keys, before any engine starts."""
    for key in ("requests", "prompt_len", "max_tokens", "prefill.tp", "prefill.dp", "decode.tp",
                "decode.dp"):
        integer(cfg, key)
    integer(cfg, "seed", minimum=0)
    number(cfg, "arrival_rate")  # 0: every request at once


def run(cfg: DictConfig, console: Console) -> dict:
    check(cfg)
    rng = random.Random(cfg.seed)
    params = SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=True)
    with _engine(cfg, cfg.prefill) as prefiller, _engine(cfg, cfg.decode) as decoder:
        vocab = prefiller.model_config.vocab_size
        prompts = [random_token_ids(cfg.prompt_len, vocab, seed=cfg.seed * 1000 + i)
                   for i in range(cfg.requests)]
        gaps = [rng.expovariate(cfg.arrival_rate) if cfg.arrival_rate > 0 else 0.0
                for _ in prompts]
        t0 = time.perf_counter()
        arrivals = [t0 + sum(gaps[:i + 1]) for i in range(len(prompts))]
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            rows = list(pool.map(lambda a: route(prefiller, decoder, *a),
                                 [(p, params, t) for p, t in zip(prompts, arrivals)]))
        wall = time.perf_counter() - t0
    result = {"prefill": dict(cfg.prefill), "decode": dict(cfg.decode), "requests": rows,
              "wall_s": wall, "ttft_p50_s": statistics.median(r["ttft_s"] for r in rows),
              "latency_p50_s": statistics.median(r["latency_s"] for r in rows),
              "output_tokens_per_s": sum(r["tokens"] for r in rows) / wall}
    _print(console, cfg, result)
    return result


def _print(console: Console, cfg: DictConfig, r: dict) -> None:
    table = Table(title=f"{cfg.model.path}: prefill tp={cfg.prefill.tp} dp={cfg.prefill.dp} -> "
                        f"decode tp={cfg.decode.tp} dp={cfg.decode.dp}")
    for col in ("request", "TTFT ms", "hand-off + decode ms", "latency ms", "tokens"):
        table.add_column(col, justify="right")
    for i, row in enumerate(r["requests"]):
        table.add_row(str(i), f"{row['ttft_s'] * 1e3:.0f}", f"{row['decode_s'] * 1e3:.0f}",
                      f"{row['latency_s'] * 1e3:.0f}", str(row["tokens"]))
    console.print(table)
    console.print(f"TTFT p50 {r['ttft_p50_s'] * 1e3:.0f} ms, latency p50 "
                  f"{r['latency_p50_s'] * 1e3:.0f} ms, {r['output_tokens_per_s']:.1f} output tokens/s "
                  f"over {r['wall_s']:.1f} s")


@hydra_app("disagg")
def main(cfg: DictConfig) -> None:
    run(cfg, Console())


if __name__ == "__main__":
    main()
