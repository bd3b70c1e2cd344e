"""Decode speed of the engine next to transformers `generate`, same weights, threads and dtype:
a 256-token prompt, 64 greedy tokens, identical tokens checked; and the rate at which decode
reads the weights, as a share of this machine's read bandwidth measured in the same run.
transformers runs in a process of its own (bench.baseline_process says why), and so does the
bandwidth measurement: a sum on this process's main thread would compete with the engine's
OpenMP team. The engine runs eager and with compile=True (its warm-up time printed beside it); a
float32 run also times decode_dtype="bfloat16" (bf16 copies of the weights for decode steps)
and says from which token on, if any, tokens differ.

    .venv/bin/python -m bench.decode_vs_transformers --repeats 3
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.common import best_of, machine, random_ids
from engine import LLM, SamplingParams
from engine.loading.checkpoint import resolve_model
from bench.baseline_process import BaselineProcess


def read_bandwidth(_model=None) -> float:
    """Bytes/s of summing a tensor far larger than the caches: a pure read. Run in the
    transformers process (`_model` is its model, unused)."""
    data = torch.ones(64 * 2**20 // 4 * 4)  # 256 MiB of float32
    return data.numel() * 4 / best_of(lambda: data.sum(), 5)


def engine_decode_s(llm: LLM, ids: list[int], n: int) -> tuple[float, list[int]]:
    start = time.perf_counter()
    [g] = llm.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))
    return (time.perf_counter() - start - g.ttft_s) / (n - 1), g.token_ids


@torch.inference_mode()
def hf_decode_s(model, ids: list[int], n: int) -> tuple[float, list[int]]:
    x = torch.tensor([ids])
    start = time.perf_counter()
    model(x, logits_to_keep=1)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    out = model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return (time.perf_counter() - start - prefill) / (n - 1), out[0, len(ids):].tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    hf = BaselineProcess(str(resolve_model("smollm2")), args.dtype, torch.get_num_threads())
    settings = {"engine": dict(dtype=args.dtype),
                "engine, compile=True": dict(dtype=args.dtype, compile=True)}
    if args.dtype == "float32":
        settings["engine, bf16 decode weights"] = dict(decode_dtype="bfloat16")
        settings["compile=True, bf16 decode weights"] = dict(decode_dtype="bfloat16", compile=True)
    best, tokens = {name: float("inf") for name in settings} | {"hf": float("inf")}, {}
    warmup = {}
    for name, extra in settings.items():
        # one engine at a time: each has its own step-loop thread, and two of them in a process
        # would slow each other down as transformers would (bench.baseline_process)
        with LLM("smollm2", enable_prefix_caching=False, **extra) as llm:
            warmup[name] = llm.rank_info()[0].warmup_s
            ids = random_ids(args.prompt_len, llm.model_config.vocab_size, seed=1)
            if name == "engine":  # the model's own weights (a bf16 copy adds to the other's)
                weight_bytes = sum(i.weight_bytes for i in llm.rank_info())
            for _ in range(args.repeats):  # alternate, so a slow spell hits both alike
                s, tokens[name] = engine_decode_s(llm, ids, args.tokens)
                best[name] = min(best[name], s)
                s, tokens["hf"] = hf.run(hf_decode_s, ids, args.tokens)
                best["hf"] = min(best["hf"], s)
    bandwidth = hf.run(read_bandwidth)
    hf.close()
    print(f"{machine()}; SmolLM2 {args.dtype}, {args.prompt_len}-token prompt, {args.tokens} "
          f"greedy tokens, best of {args.repeats}")
    print(f"transformers {1 / best['hf']:6.1f} tok/s")
    for name in settings:
        read = weight_bytes * (0.5 if "bf16" in name else 1.0)
        print(f"{name:<34} {1 / best[name]:6.1f} tok/s  ratio {best['hf'] / best[name]:.2f}x  "
              f"{_agreement(tokens[name], tokens['hf'])}; weights read per token "
              f"{read / 1e6:.0f} MB at {read / best[name] / 1e9:.1f} GB/s = "
              f"{read / best[name] / bandwidth:.0%} of the {bandwidth / 1e9:.1f} GB/s read "
              f"bandwidth measured here" + (f"; warm-up {warmup[name]:.0f} s" if warmup[name] else ""))


def _agreement(ours: list[int], theirs: list[int]) -> str:
    if ours == theirs:
        return "identical tokens"
    first = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    return f"tokens differ from token {first} on"


if __name__ == "__main__":
    main()
