"""`prefill bench`: TTFT, prefill and decode speed, TFLOP/s and MFU, memory per rank and per
node, side by side with transformers on the same prompt; one JSON line per run, and plots."""
from __future__ import annotations

import launcher  # noqa: F401  first: run by its path, it relaunches preloaded before torch loads

import json
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, open_dict
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from engine import SamplingParams
from engine.loading.checkpoint import resolve_model
from engine.observe.costs import forward_flops
from engine.observe.hardware import hardware
from engine.loading.synthetic import random_token_ids
from launcher.hydra_main import boolean, hydra_app, integer
from launcher.build_engine import llm_from_config



def _best_ttft(llm, ids: list[int], repeats: int) -> float:
    return min(llm.prefill([ids])[0].ttft_s for _ in tqdm(range(repeats), desc="prefill", leave=False))


def _baseline_s(cfg: DictConfig, llm, ids: list[int]) -> float | None:
    if not cfg.baseline:
        return None
    from launcher.baseline import hf_model, hf_prefill

    model = hf_model(str(resolve_model(cfg.model.path)), llm.config.torch_dtype)
    hf_prefill(model, ids)  # warm-up
    times = []
    for _ in tqdm(range(cfg.repeats), desc="transformers", leave=False):
        start = time.perf_counter()
        hf_prefill(model, ids)
        times.append(time.perf_counter() - start)
    return min(times)


def _per_node(llm) -> dict:
    """Ranks and resident memory per node (keyed by address and Ray node id: several nodes
    may share one address, as in a test cluster on one machine)."""
    nodes: dict[str, dict] = {}
    for ranks, memory in zip(llm.placement(), llm.rank_memory()):
        for (ip, node_id), mem in zip(ranks, memory):
            key = ip if node_id == "local" else f"{ip} {node_id[:8]}"
            node = nodes.setdefault(key, {"ranks": 0, "resident_bytes": 0})
            node["ranks"] += 1
            node["resident_bytes"] += mem["resident_bytes"]
    return nodes


def check(cfg: DictConfig) -> None:
    """The app's own keys, before any model loads."""
    for key in ("prompt_len", "decode_tokens", "repeats"):
        integer(cfg, key)
    boolean(cfg, "baseline")


def measure(cfg: DictConfig) -> dict:
    check(cfg)
    with open_dict(cfg):
        cfg.engine.max_num_batched_tokens = max(cfg.engine.max_num_batched_tokens, cfg.prompt_len)
    with llm_from_config(cfg) as llm:
        mc, hw = llm.model_config, hardware(cfg.hardware, llm.config.device, llm.config.torch_dtype)
        ids = random_token_ids(cfg.prompt_len, mc.vocab_size, seed=cfg.prompt_len)
        llm.prefill([ids[:8]])  # warm-up
        ttft = _best_ttft(llm, ids, cfg.repeats)
        start = time.perf_counter()
        [g] = llm.generate([ids], SamplingParams(max_tokens=cfg.decode_tokens, ignore_eos=True))
        decode_s = time.perf_counter() - start - g.ttft_s
        flops = forward_flops(mc, cfg.prompt_len, cfg.prompt_len)
        baseline = _baseline_s(cfg, llm, ids)
        return {
            "model": cfg.model.path, "tp": llm.config.tp, "dp": llm.config.dp,
            "dtype": str(llm.config.torch_dtype).replace("torch.", ""), "device": llm.config.device,
            "prompt_len": cfg.prompt_len, "ttft_s": ttft, "prefill_tok_s": cfg.prompt_len / ttft,
            "prefill_tflops": flops / ttft / 1e12, "mfu": flops / ttft / hw.peak_flops,
            "hardware": hw.name, "decode_tok_s": (cfg.decode_tokens - 1) / decode_s,
            "transformers_ttft_s": baseline,
            "speedup_vs_transformers": baseline / ttft if baseline else None,
            "ranks": [{"rank": i.rank, "weight_bytes": i.weight_bytes,
                       "kv_cache_bytes": i.kv_cache_bytes} for i in llm.rank_info()],
            "nodes": _per_node(llm), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        }


def _print(console: Console, r: dict) -> None:
    t = Table(title=f"{r['model']} tp={r['tp']} dp={r['dp']} {r['dtype']} on {r['device']}: "
                    f"{r['prompt_len']}-token prompt", title_justify="left")
    for col in ("TTFT", "prefill tok/s", "TFLOP/s", "MFU", "decode tok/s", "transformers TTFT", "ratio"):
        t.add_column(col, justify="right")
    base = r["transformers_ttft_s"]
    t.add_row(f"{r['ttft_s'] * 1e3:.1f} ms", f"{r['prefill_tok_s']:.0f}", f"{r['prefill_tflops']:.4f}",
              f"{r['mfu']:.1%} of {r['hardware']}", f"{r['decode_tok_s']:.1f}",
              f"{base * 1e3:.1f} ms" if base else "-",
              f"{r['speedup_vs_transformers']:.2f}x" if base else "-")
    console.print(t)
    for ip, node in r["nodes"].items():
        console.print(f"  node {ip}: {node['ranks']} rank(s), {node['resident_bytes'] / 2**20:.0f} MiB resident")


@hydra_app("bench")
def main(cfg: DictConfig) -> None:
    from report.plots import bench_plots

    console = Console() if sys.stdout.isatty() else Console(width=150)
    result = measure(cfg)
    _print(console, result)
    path = Path(cfg.results)
    with path.open("a") as f:
        f.write(json.dumps(result) + "\n")
    written = bench_plots(path, Path(cfg.plots_dir))
    console.print(f"appended to {path}; plots: {', '.join(map(str, written))}")


if __name__ == "__main__":
    main()
