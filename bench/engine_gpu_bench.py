"""The engine's prefill of a random model with Llama-3-8B's layer shape, through the public API
only (`LLM(path, ...)`): prefill at each length with MFU against the matmul peak measured in the
same run, a chunk after a cached prefix, decode, compile on vs off, and a torch.profiler split of
one longest prefill into GEMM / attention / other kernels / idle. Called by bench.kernel_bench.

Llama-3-8B layer: hidden 4096, 32 query / 8 KV heads of 128, FFN 14336 (vocabulary 32000 here
instead of 128256: the LM head runs on the last position only, and a smaller file loads faster).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import print_table

LLAMA3_8B_LAYERS = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=32000, rope_theta=500000.0)
TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, rope_theta=10000.0)
GEMM = ("gemm", "cutlass", "xmma", "nvjet", "matmul", "cublas", "aten::mm", "aten::addmm",
        "aten::bmm")
ATTENTION = ("flash", "attention", "fmha", "decode_split", "decode_merge", "sdpa")
TOP_KERNELS = 10


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--layers", type=int, default=4, help="layers of the 8B-shaped model (4-8)")
    ap.add_argument("--engine-lengths", type=int, nargs="+", default=None,
                    help="prefill lengths (default: --lengths)")
    ap.add_argument("--engine-repeats", type=int, default=None)
    ap.add_argument("--decode-tokens", type=int, default=None)
    ap.add_argument("--engine-backend", choices=["auto", "torch", "triton"], default="triton")
    ap.add_argument("--skip-compile", action="store_true", help="skip the compile=True run")
    ap.add_argument("--skip-profile", action="store_true")


def save_model(root: Path, shape: dict, layers: int, max_len: int, device: torch.device) -> Path:
    """A Llama of `shape` with random weights saved with save_pretrained in bf16, built on the
    device (a billion parameters initialise in seconds there and far slower on the host)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cfg = AutoConfig.for_model("llama", **shape, num_hidden_layers=layers,
                               max_position_embeddings=max(8192, 2 * max_len))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.to("cpu").save_pretrained(root)
    del model
    return root


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ids(length: int, vocab: int, seed: int) -> list[int]:
    """A fresh prompt per seed, so the prefix cache never serves a timed run by accident."""
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _timed_prefill(llm, ids: list[int], device: torch.device):
    _sync(device)
    start = time.perf_counter()
    [out] = llm.prefill([ids])  # returns host logits: the device work is done when it returns
    return time.perf_counter() - start, out


def prefill_rows(llm, args, device: torch.device, peak: float | None) -> list[dict]:
    from engine.observe.costs import forward_flops

    mc, rows = llm.model_config, []
    for length in args.engine_lengths:
        _timed_prefill(llm, _ids(length, mc.vocab_size, 10_000 + length), device)  # warm-up
        walls = [_timed_prefill(llm, _ids(length, mc.vocab_size, length * 100 + r), device)[0]
                 for r in range(args.engine_repeats)]
        wall = statistics.median(walls)
        tf = forward_flops(mc, length, length) / wall / 1e12
        rows.append({"tokens": length, "ms": wall * 1e3, "tok_per_s": length / wall,
                     "tflops": tf, "mfu": tf / peak if peak else None})
    return rows


def prefix_chunk_row(llm, args, device: torch.device) -> dict:
    """The longest length's last eighth as a new chunk after the rest, already cached."""
    vocab, length = llm.model_config.vocab_size, max(args.engine_lengths)
    chunk = max(length // 8, 1)
    prefix = _ids(length - chunk, vocab, 7)
    llm.prefill([prefix])  # now cached (whole blocks of it)
    wall, out = _timed_prefill(llm, prefix + _ids(chunk, vocab, 8), device)
    return {"context": length, "new_tokens": length - out.cached_tokens,
            "cached_tokens": out.cached_tokens, "ms": wall * 1e3}


def decode_row(llm, args, device: torch.device) -> dict:
    from engine import SamplingParams

    ids = _ids(min(args.engine_lengths), llm.model_config.vocab_size, 9)
    params = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([ids[:16]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    _sync(device)
    start = time.perf_counter()
    [g] = llm.generate([ids], params)
    decode_s = time.perf_counter() - start - g.ttft_s
    steps = len(g.token_ids) - 1  # the first token comes from the prefill
    return {"prompt": len(ids), "tokens": len(g.token_ids), "decode_s": decode_s,
            "tok_per_s": steps / decode_s if decode_s > 0 else None}


def profile_split(llm, args, device: torch.device) -> dict:
    """One longest prefill under torch.profiler: device time by kernel class, and idle as the
    wall time no kernel covered (one stream: kernels do not overlap)."""
    from torch.profiler import ProfilerActivity, profile

    length = max(args.engine_lengths)
    ids = _ids(length, llm.model_config.vocab_size, 11)
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        wall, _ = _timed_prefill(llm, ids, device)
    split, kernels = {"gemm": 0.0, "attention": 0.0, "other": 0.0}, {}
    for evt in prof.key_averages():
        on_device = cuda and evt.device_type == torch.autograd.DeviceType.CUDA
        if cuda and not on_device or (not cuda and not evt.key.startswith("aten::")):
            continue
        us = evt.self_device_time_total if cuda else evt.self_cpu_time_total
        name = evt.key.lower()
        kind = ("gemm" if any(g in name for g in GEMM)
                else "attention" if any(a in name for a in ATTENTION) else "other")
        split[kind] += us / 1e3
        kernels[evt.key[:100]] = (round(us / 1e3, 3), evt.count)
    busy = sum(split.values())
    split = {k: round(v, 3) for k, v in split.items()}
    # the costliest kernels by name: where a compiled step's time goes against an eager one's
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    return {"tokens": length, "wall_ms": wall * 1e3, **{f"{k}_ms": v for k, v in split.items()},
            "idle_ms": max(0.0, wall * 1e3 - busy),
            "top_kernels": [{"name": n, "ms": ms, "calls": c} for n, (ms, c) in top],
            "note": "device kernel time" if cuda else "CPU aten ops (interpreted Triton is "
                                                      "Python, so it lands in idle)"}


def _settings(args, device: torch.device, max_len: int, per_token: int) -> dict:
    kv_gb = max(0.25, 3 * per_token * (max_len + 64) / 2**30)  # the prefix run holds two prompts
    return dict(device=str(device), dtype="bfloat16" if device.type == "cuda" else "float32",
                max_num_batched_tokens=max_len, kv_cache_gb=kv_gb, step_timeout_s=900.0,
                attention_backend=args.engine_backend)


def compile_rows(path: str, settings: dict, args, device: torch.device) -> dict:
    """compile=True beside the eager figures: start-up (compile, autotune, graph capture) and
    prefill."""
    from engine import LLM

    start = time.perf_counter()
    with LLM(path, **settings, compile=True) as llm:
        startup = time.perf_counter() - start
        return {"startup_s": startup, "prefill": prefill_rows(llm, args, device, None)}


def bench_engine(args, device: torch.device, report: dict) -> dict:
    from engine import LLM
    from engine.rank.kv_cache import KVCache

    small = args.cpu_dry_run or device.type != "cuda"
    args.engine_lengths = args.engine_lengths or args.lengths
    args.engine_repeats = args.engine_repeats or (1 if small else 3)
    args.decode_tokens = args.decode_tokens or (4 if small else 64)
    peak = (report.get("matmul_peak") or {}).get("tflops")
    max_len = max(args.engine_lengths)
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="engine_gpu_bench_") as tmp:
        start = time.perf_counter()
        shape, layers = (TINY, 2) if small else (LLAMA3_8B_LAYERS, args.layers)
        path = str(save_model(Path(tmp), shape, layers, max_len, device))
        out["build_s"] = time.perf_counter() - start
        per_token = KVCache.bytes_per_token(layers,
                                            shape["num_key_value_heads"],
                                            shape["hidden_size"] // shape["num_attention_heads"],
                                            torch.bfloat16)
        settings = _settings(args, device, max_len, per_token)
        start = time.perf_counter()
        with LLM(path, **settings) as llm:
            out["load_s"] = time.perf_counter() - start
            mc = llm.model_config
            out["model"] = {"hidden": mc.hidden_size, "ffn": mc.intermediate_size,
                            "layers": mc.num_layers, "heads": mc.num_heads,
                            "kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim,
                            "vocab": mc.vocab_size, "settings": settings}
            out["prefill"] = prefill_rows(llm, args, device, peak)
            out["prefix_chunk"] = prefix_chunk_row(llm, args, device)
            out["decode"] = decode_row(llm, args, device)
            if not args.skip_profile:
                out["profile"] = profile_split(llm, args, device)
        if not args.skip_compile:
            out["compile"] = compile_rows(path, settings, args, device)
    _print(out, peak)
    return out


def _print(out: dict, peak: float | None) -> None:
    m = out["model"]
    rows = [[r["tokens"], f"{r['ms']:.2f}", f"{r['tok_per_s']:,.0f}", f"{r['tflops']:.3g}",
             f"{100 * r['mfu']:.1f}%" if r["mfu"] else "n/a"] for r in out["prefill"]]
    print_table(f"Engine prefill, TP=1 | random Llama: hidden {m['hidden']}, ffn {m['ffn']}, "
                f"{m['layers']} layers, {m['heads']}/{m['kv_heads']} heads of {m['head_dim']} | "
                f"built {out['build_s']:.1f} s, loaded {out['load_s']:.1f} s | MFU against the "
                f"matmul peak measured above ({f'{peak:.3g}' if peak else 'none'} TF/s)",
                ["tokens", "ms", "tok/s", "TF/s", "MFU"], rows)
    print(f"prefix + chunk: {out['prefix_chunk']}")
    print(f"decode: {out['decode']}")
    if "profile" in out:
        print(f"profile of one prefill: {out['profile']}")
    if "compile" in out:
        print(f"compile=True: {out['compile']}")
