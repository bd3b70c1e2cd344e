"""Attention kernels against torch SDPA, the device's matmul peak, and (bench.engine_gpu_bench)
an 8B-shaped engine prefill, all in one run on this machine's device; JSON with --json.

    python -m bench.kernel_bench --json $OUT/kernel_bench.json      # GPU: L = 1k 2k 8k
    python -m bench.kernel_bench --cpu-dry-run                      # CPU: tiny, interpreted

Attention: one causal sequence of L new tokens (32 query / 8 KV heads, head dim 64 and 128)
through engine.rank.kernels.triton_attention over a paged cache (autotuned on CUDA; its step
metadata built once, outside the timing, as the engine does per step) against
torch.nn.functional.scaled_dot_product_attention, naming the SDPA backend torch picked. Then a
chunk of L/8 queries over an L-token context, and a decode step of 16 sequences of L tokens.
On a CPU the kernels run under the Triton interpreter: the numbers only show the script works.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from typing import Callable

import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:  # triton reads this when the kernels are decorated, i.e. at their import below
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from bench.common import print_table  # noqa: E402
from bench.engine_gpu_bench import add_args, bench_engine  # noqa: E402
from engine.rank.kernels import triton_attention, triton_decode_attention  # noqa: E402
from engine.rank.kernels.flash_attention import _flash_prefill_tuned  # noqa: E402
from engine.rank.step_metadata import build_step_metadata  # noqa: E402
from engine.rank.kv_cache import KVCache  # noqa: E402

HEADS, KV_HEADS, BLOCK_SIZE = 32, 8, 16


def device_label(device: torch.device) -> str:
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({versions})"
    interp = ", interpreted" if os.environ.get("TRITON_INTERPRET") == "1" else ""
    return f"CPU, {torch.get_num_threads()} threads ({versions}{interp})"


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median milliseconds of fn after warm-up runs (compiles and autotuning happen there). On a
    GPU each run is bracketed by CUDA events, so queued work is counted where it runs."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in events)


def tflops(flops: float, ms: float) -> float:
    return flops / ms / 1e9


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int, args) -> dict:
    """The dense matmul rate this device reaches in `dtype` now (clocks and power as they are),
    the denominator of every MFU in this run."""
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    ms = time_ms(lambda: a @ b, device, max(1, args.warmup), max(3, args.iters))
    out = {"n": n, "dtype": str(dtype), "ms": ms, "tflops": tflops(2 * n**3, ms)}
    print(f"\nmatmul peak: [{n}x{n}] @ [{n}x{n}] {dtype}: {ms:.3f} ms, {out['tflops']:.1f} TFLOP/s")
    return out


def sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str:
    """The backend torch's dispatcher picks for these inputs (flash, efficient, cudnn, math)."""
    try:
        from torch.nn.attention import SDPBackend
        choice = torch._fused_sdp_choice(q, k, v, is_causal=causal)
        return SDPBackend(choice).name
    except Exception as e:  # a private helper: name what went wrong rather than fail the run
        return f"unknown ({type(e).__name__})"


def paged(q_lens: list[int], ctx_lens: list[int], head_dim: int, dtype: torch.dtype,
          device: torch.device, seed: int = 0):
    """q/k/v of the new tokens, a cache holding every context with shuffled pages (the kernel
    reads through the block table as in the engine), and the step's metadata, built once."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // BLOCK_SIZE) for n in ctx_lens]
    perm = torch.randperm(sum(blocks), generator=gen).tolist()
    tables, at = [], 0
    for n in blocks:
        tables.append(perm[at:at + n])
        at += n
    cache = KVCache(1, sum(blocks), BLOCK_SIZE, KV_HEADS, head_dim, dtype, device)
    cache.data.normal_(generator=None)
    slots = [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
             for t, q, c in zip(tables, q_lens, ctx_lens) for p in range(c - q, c)]
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    heads = [h // (HEADS // KV_HEADS) for h in range(HEADS)]
    step = build_step_metadata(cu, ctx_lens, tables, slots, heads, device, uniform_groups=True)
    t = cu[-1]
    q, k, v = (torch.randn(t, h, head_dim, generator=gen).to(device, dtype)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    cache.store(0, k, v, step.slot_mapping.long())
    return q, k, v, cache, step


def _sdpa_inputs(cache: KVCache, step, q: torch.Tensor, seq: int):
    """[1, h, len, d] q and K/V of one sequence gathered from the cache, expanded to every query
    head ahead of time: layout and GQA expansion are setup, not the attention being timed."""
    k, v = cache.gather(0, step.block_tables[seq], step.context_lens[seq])
    cu = step.cu_seqlens_q
    q4 = q[cu[seq]:cu[seq + 1]].transpose(0, 1).unsqueeze(0).contiguous()
    k4, v4 = (x.repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1).unsqueeze(0).contiguous()
              for x in (k, v))
    return q4, k4, v4


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.float()
    return ((actual.float() - expected).norm() / expected.norm()).item()


def causal_pairs(q_len: int, kv_len: int) -> int:
    """Query-key pairs a causal chunk of q_len queries at the end of kv_len positions sees."""
    return q_len * (kv_len - q_len) + q_len * (q_len + 1) // 2


def prefill_row(length: int, q_len: int, head_dim: int, dtype: torch.dtype,
                device: torch.device, args, autotune: bool | None = None) -> dict:
    """One sequence: q_len new tokens at the end of a length-token context (q_len == length:
    a whole prompt, else a chunk after a cached prefix). autotune=False: the default tile."""
    from torch.nn.attention.bias import causal_lower_right

    q, k, v, cache, step = paged([q_len], [length], head_dim, dtype, device)
    scale = head_dim ** -0.5
    q4, k4, v4 = _sdpa_inputs(cache, step, q, 0)
    whole = q_len == length
    mask = None if whole else causal_lower_right(q_len, length)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q4, k4, v4, attn_mask=mask, is_causal=whole, scale=scale)
    triton_fn = lambda: triton_attention(0, q, k, v, cache, step, scale,  # noqa: E731
                                         autotune=autotune)
    err = rel_err(triton_fn(), sdpa()[0].transpose(0, 1))  # checked once, untimed
    flops = 4 * HEADS * head_dim * causal_pairs(q_len, length)
    t_ms = time_ms(triton_fn, device, args.warmup, args.iters)
    s_ms = time_ms(sdpa, device, args.warmup, args.iters)
    backend = (sdpa_backend(q4, k4, v4, True) if whole
               else "causal_lower_right bias (efficient kernel where it applies)")
    best = getattr(_flash_prefill_tuned, "best_config", None)
    return {"kind": "prefill" if whole else "chunk", "kv_len": length, "q_len": q_len,
            "head_dim": head_dim, "triton_ms": t_ms, "sdpa_ms": s_ms,
            "triton_tflops": tflops(flops, t_ms), "sdpa_tflops": tflops(flops, s_ms),
            "sdpa_backend": backend, "rel_err": err,
            "triton_config": "default tile" if autotune is False else
            str(best) if best is not None and device.type == "cuda" else "fixed (interpreter)"}


def decode_row(length: int, head_dim: int, dtype: torch.dtype, device: torch.device,
               args) -> dict:
    """args.decode_seqs sequences of `length` tokens, one new query each: memory-bound, so
    reported as the rate K/V is read."""
    seqs = args.decode_seqs
    q, k, v, cache, step = paged([1] * seqs, [length] * seqs, head_dim, dtype, device)
    scale = head_dim ** -0.5
    gathered = [_sdpa_inputs(cache, step, q, i) for i in range(seqs)]
    q4, k4, v4 = (torch.cat(x) for x in zip(*gathered))  # [seqs, h, len, d]
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q4, k4, v4, scale=scale)
    triton_fn = lambda: triton_decode_attention(0, q, k, v, cache, step, scale)  # noqa: E731
    err = rel_err(triton_fn(), sdpa()[:, :, 0])
    kv_bytes = 2 * seqs * length * KV_HEADS * head_dim * dtype.itemsize
    t_ms = time_ms(triton_fn, device, args.warmup, args.iters)
    s_ms = time_ms(sdpa, device, args.warmup, args.iters)
    # SDPA reads the K/V expanded to every query head: HEADS/KV_HEADS times the bytes
    return {"kind": "decode", "kv_len": length, "q_len": 1, "seqs": seqs, "head_dim": head_dim,
            "triton_ms": t_ms, "sdpa_ms": s_ms, "triton_kv_gbps": kv_bytes / t_ms / 1e6,
            "kv_per_split": step.decode_kv_per_split,
            "sdpa_backend": sdpa_backend(q4, k4, v4, False) + f" over K/V expanded to {HEADS} heads",
            "rel_err": err}


def bench_attention(args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    rows = []
    for head_dim in args.head_dims:
        for length in args.lengths:
            rows.append(prefill_row(length, length, head_dim, dtype, device, args))
            rows.append(prefill_row(length, max(1, length // 8), head_dim, dtype, device, args))
            rows.append(decode_row(length, head_dim, dtype, device, args))
    table = [[r["kind"], r["head_dim"], r["q_len"], r["kv_len"], f"{r['triton_ms']:.3f}",
              f"{r['sdpa_ms']:.3f}", f"{r['sdpa_ms'] / r['triton_ms']:.2f}",
              f"{r.get('triton_tflops', 0):.3g}", f"{r.get('sdpa_tflops', 0):.3g}",
              f"{r.get('triton_kv_gbps', 0):.3g}", f"{r['rel_err']:.1e}", r["sdpa_backend"]]
             for r in rows]
    print_table(f"Attention | {device_label(device)} | {dtype} | {HEADS} q / {KV_HEADS} kv heads, "
                f"page {BLOCK_SIZE} | median of {args.iters} after {args.warmup} warm-up\n"
                f"TF/s counts causal work only (4*h*d per visible pair); speedup = SDPA ms / "
                f"triton ms; decode: {args.decode_seqs} sequences, GB/s of K/V read by the kernel",
                ["kind", "d", "q", "kv", "triton ms", "sdpa ms", "speedup", "triton TF/s",
                 "sdpa TF/s", "dec GB/s", "rel.err", "SDPA backend"], table)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="tiny shapes, Triton interpreted: proves the script runs, times nothing")
    ap.add_argument("--lengths", type=int, nargs="+", default=None)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--peak-n", type=int, default=None, help="matmul size for the peak")
    ap.add_argument("--decode-seqs", type=int, default=None)
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--skip-engine", action="store_true")
    add_args(ap)
    args = ap.parse_args(argv)
    small = args.cpu_dry_run or not ON_CUDA
    args.lengths = args.lengths or ([48, 80] if small else [1024, 2048, 8192])
    args.warmup = args.warmup if args.warmup is not None else (0 if small else 3)
    args.iters = args.iters or (1 if small else 20)
    args.peak_n = args.peak_n or (256 if small else 8192)
    args.decode_seqs = args.decode_seqs or (2 if small else 16)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda" if ON_CUDA else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.set_grad_enabled(False)
    report: dict = {"device": device_label(device), "argv": sys.argv, "failed": []}
    sections = [("matmul_peak", lambda: matmul_peak(device, dtype, args.peak_n, args)),
                ("attention", lambda: bench_attention(args, device, dtype))]
    if not args.skip_engine:
        sections.append(("engine", lambda: bench_engine(args, device, report)))
    for name, run in sections:
        start = time.perf_counter()
        try:  # one lent GPU run should still bring back the other sections' numbers
            report[name] = run()
        except Exception:
            traceback.print_exc()
            report["failed"].append(name)
        report[f"{name}_s"] = round(time.perf_counter() - start, 1)
        if args.json:  # after every section, so a run cut short still leaves what it had
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1, default=str)
    if report["failed"]:
        sys.exit(f"kernel_bench: section(s) failed: {', '.join(report['failed'])}")


if __name__ == "__main__":
    main()
