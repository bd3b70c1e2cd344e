"""Causal prefill attention and whole-engine prefill, timed on this machine's device.

    .venv/bin/python -m bench.kernel_bench                       # GPU: L = 512 2048 8192
    .venv/bin/python -m bench.kernel_bench --lengths 64 128      # CPU: Triton interpreted

Section 1 times one sequence of L new tokens (32 query heads, 8 KV heads, head dim 128) through
(a) engine.rank.kernels.triton_attention over a paged cache, as the engine calls it, (b) torch SDPA
and (c) a naive attention that materialises the scores. Section 2 times the engine's prefill of a
random ~1B Llama (a tiny one on a CPU) at TP=1. On a CPU the Triton kernels run under the
interpreter, so the numbers there only show that the script works, not how fast anything is.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:  # triton reads this when the kernels are decorated, i.e. at their import below
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from engine.rank.attention import AttentionMetadata  # noqa: E402
from engine.rank.kernels import triton_attention  # noqa: E402
from engine.rank.kv_cache import KVCache  # noqa: E402

if TYPE_CHECKING:
    from engine import LLM

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
# random models: a ~1.1B Llama (GQA 32/8, like Llama 3.2 1B) and a tiny one that runs in seconds
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)
LLAMA_TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)


# ---- measuring ---------------------------------------------------------------------------------

def device_label(device: torch.device) -> str:
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({versions})"
    interp = ", interpreted" if os.environ.get("TRITON_INTERPRET") == "1" else ""
    return f"CPU, {torch.get_num_threads()} threads ({versions}{interp})"


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median milliseconds of fn after warm-up runs (Triton compiles and caches warm there).
    On a GPU each run is bracketed by CUDA events, so queued work is counted where it runs; the
    median keeps one slow run (a clock ramp, a stray sync) from moving the result."""
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


def causal_flops(heads: int, head_dim: int, length: int) -> int:
    """QK^T and PV, 2 FLOPs per multiply-add each, over the L(L+1)/2 visible query-key pairs."""
    return 4 * heads * head_dim * length * (length + 1) // 2


def fmt_tflops(tflops: float) -> str:
    """Interpreted kernels reach ~1e-6 TFLOP/s: keep a digit there too."""
    return f"{tflops:.2f}" if tflops >= 0.01 else f"{tflops:.1e}"


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.float()
    return ((actual.float() - expected).norm() / expected.norm()).item()


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    print(f"\n{title}\n{line}")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    print(line)
    for r in rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))
    print(line, flush=True)


# ---- section 1: attention ----------------------------------------------------------------------

def paged_inputs(length: int, dtype: torch.dtype, device: torch.device, seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, KVCache, AttentionMetadata]:
    """q/k/v of L new tokens and an empty paged cache whose pages are shuffled, so the kernel
    reads K/V through the block table the way it does in the engine."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-length // BLOCK_SIZE)
    table = torch.randperm(num_blocks, generator=gen)
    pos = torch.arange(length)
    slots = (table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).to(device)
    group = HEADS // KV_HEADS
    kv_head_of_q = torch.arange(HEADS, device=device) // group
    meta = AttentionMetadata([0, length], [length], [table.tolist()], slots, kv_head_of_q)
    cache = KVCache(1, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype, device)
    q = torch.randn(length, HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    k = torch.randn(length, KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    v = torch.randn(length, KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    return q, k, v, cache, meta


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """[1, h, L, d] inputs; the whole [h, L, L] score matrix exists, softmax in fp32."""
    length = q.shape[-2]
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu_(1)
    scores.masked_fill_(future, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)


def naive_gib(length: int, dtype: torch.dtype) -> float:
    """Scores in the input dtype, their fp32 copy, fp32 probabilities and their cast back."""
    return HEADS * length * length * (2 * dtype.itemsize + 8) / 2**30


def attention_rows(length: int, dtype: torch.dtype, device: torch.device,
                   args: argparse.Namespace) -> list[list[str]]:
    q, k, v, cache, meta = paged_inputs(length, dtype, device)
    scale = HEAD_DIM ** -0.5
    # SDPA gets [1, h, L, d] with K/V expanded to every query head ahead of time: the layout
    # change and the GQA expansion are setup, not part of the attention being timed
    q4 = q.transpose(0, 1).unsqueeze(0).contiguous()
    k4, v4 = (x.index_select(1, meta.kv_head_of_q).transpose(0, 1).unsqueeze(0).contiguous()
              for x in (k, v))
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q4, k4, v4, is_causal=True, scale=scale)
    ref = sdpa()[0].transpose(0, 1)
    cache.store(0, k, v, meta.slot_mapping)  # attention reads the new K/V from the cache
    impls = {"triton paged": lambda: triton_attention(0, q, k, v, cache, meta, scale),
             "torch SDPA": sdpa}
    need = naive_gib(length, dtype)
    if need <= args.naive_max_gb:
        impls["naive"] = lambda: naive_attention(q4, k4, v4, scale)
    flops = causal_flops(HEADS, HEAD_DIM, length)
    results = {}
    for name, fn in impls.items():
        out = fn()  # checked once, untimed; the timed runs reuse the same buffers
        out = out if name == "triton paged" else out[0].transpose(0, 1)
        results[name] = (time_ms(fn, device, args.warmup, args.iters), rel_err(out, ref))
    sdpa_ms = results["torch SDPA"][0]
    rows = [[length, name, f"{ms:.3f}", fmt_tflops(flops / ms / 1e9), f"{ms / sdpa_ms:.2f}",
             "ref" if name == "torch SDPA" else f"{err:.1e}"]
            for name, (ms, err) in results.items()]
    if "naive" not in impls:
        rows.append([length, "naive", f"skipped: ~{need:.0f} GiB", "", "", ""])
    return rows


def bench_attention(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    rows = []
    for length in args.lengths:
        rows += attention_rows(length, dtype, device, args)
    title = (f"Causal prefill attention, one sequence | {device_label(device)} | {dtype} | "
             f"heads {HEADS}, kv heads {KV_HEADS}, head dim {HEAD_DIM}, block {BLOCK_SIZE} | "
             f"median of {args.iters} after a check run and {args.warmup} warm-up\n"
             f"TFLOP/s counts the causal work 4*h*d*L(L+1)/2 for every row; t/SDPA > 1 is slower "
             f"than SDPA; 'triton paged' includes its K/V store into the cache; rel.err is "
             f"|out - SDPA| / |SDPA|")
    print_table(title, ["L", "impl", "ms", "TFLOP/s", "t/SDPA", "rel.err"], rows)


# ---- section 2: whole-engine prefill -----------------------------------------------------------

def save_random_llama(root: Path, tiny: bool, max_len: int, device: torch.device) -> Path:
    """A random Llama saved with save_pretrained in bf16. Built on the target device: random
    init of a billion parameters is seconds there and far longer on the host."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its bar would break up the log's tables
    shape = LLAMA_TINY if tiny else LLAMA_1B
    cfg = AutoConfig.for_model("llama", **shape, max_position_embeddings=max(8192, max_len))
    torch.manual_seed(0)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    except Exception as e:  # slower, but a benchmark should not die over where weights start
        print(f"building the model on {device} failed ({e!r}); building it on the CPU")
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.to("cpu").save_pretrained(root)  # the file is written from host memory either way
    del model
    return root


def engine_row(llm: "LLM", length: int, args: argparse.Namespace,
               device: torch.device) -> list[str]:
    from engine.observe.costs import forward_flops

    ids = torch.randint(0, llm.model_config.vocab_size, (length,),
                        generator=torch.Generator().manual_seed(length)).tolist()
    for _ in range(args.engine_warmup):
        llm.prefill([ids])  # compiles the kernels for this shape
    walls, forwards = [], []
    for _ in range(args.engine_repeats):
        before = len(llm.step_timings())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        llm.prefill([ids])  # returns host logits, so the device work is done when it returns
        walls.append(time.perf_counter() - start)
        forwards.append(sum(s.forward_s for s in llm.step_timings()[before:]))
    wall, fwd = statistics.median(walls), statistics.median(forwards)
    tflops = forward_flops(llm.model_config, length, length) / wall / 1e12
    mfu = f"{100 * tflops / args.peak_tflops:.1f}%" if device.type == "cuda" else "n/a"
    return [length, f"{wall * 1e3:.2f}", f"{fwd * 1e3:.2f}", f"{length / wall:,.0f}",
            fmt_tflops(tflops), mfu]


def bench_engine(args: argparse.Namespace, device: torch.device, dtype: str) -> None:
    from engine import LLM
    from engine.rank.backend import select_backend

    tiny = args.model == "tiny"
    max_len = max(args.engine_lengths)
    with tempfile.TemporaryDirectory(prefix="kernel_bench_") as tmp:
        start = time.perf_counter()
        path = save_random_llama(Path(tmp), tiny, max_len, device)
        built = time.perf_counter() - start
        # room for the longest prompt plus a block, whatever the model's KV width
        shape = LLAMA_TINY if tiny else LLAMA_1B
        per_token = KVCache.bytes_per_token(shape["num_hidden_layers"],
                                            shape["num_key_value_heads"],
                                            shape["hidden_size"] // shape["num_attention_heads"],
                                            getattr(torch, dtype))
        kv_gb = max(0.25, 1.5 * per_token * (max_len + 2 * BLOCK_SIZE) / 2**30)
        start = time.perf_counter()
        with LLM(str(path), device=str(device), dtype=dtype, max_num_batched_tokens=max_len,
                 enable_prefix_caching=False, kv_cache_gb=kv_gb,
                 attention_backend=args.engine_backend) as llm:
            loaded = time.perf_counter() - start
            rows = [engine_row(llm, n, args, device) for n in args.engine_lengths]
            mc = llm.model_config
    backend = select_backend(args.engine_backend, str(device)).name
    title = (f"Engine prefill, TP=1, one prompt of L tokens | {device_label(device)} | {dtype} | "
             f"backend {backend}\nrandom Llama ({'tiny' if tiny else '~1B'}): hidden "
             f"{mc.hidden_size}, ffn {mc.intermediate_size}, layers {mc.num_layers}, heads "
             f"{mc.num_heads}/{mc.num_kv_heads} kv, head dim {mc.head_dim}, vocab "
             f"{mc.vocab_size} | built+saved {built:.1f} s, loaded {loaded:.1f} s | median of "
             f"{args.engine_repeats} after {args.engine_warmup} warm-up\nms: whole prefill call; "
             f"fwd ms: rank 0 inside the forward; TFLOP/s from engine.observe.costs.forward_flops over "
             f"ms; MFU against {args.peak_tflops:g} TFLOP/s")
    print_table(title, ["L", "ms", "fwd ms", "tok/s", "TFLOP/s", "MFU"], rows)


# ---- entry point -------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    gpu = ON_CUDA
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+",
                    default=[512, 2048, 8192] if gpu else [64, 128],
                    help="attention sequence lengths (CPU default is tiny: interpreted Triton)")
    ap.add_argument("--engine-lengths", type=int, nargs="+", default=None,
                    help="engine prefill lengths (default: --lengths)")
    # an untimed correctness run precedes each timing and warms up too, so on a CPU, where one
    # interpreted call takes seconds, it is the only warm-up by default
    ap.add_argument("--warmup", type=int, default=3 if gpu else 0,
                    help="warm-up runs after the untimed correctness run")
    ap.add_argument("--iters", type=int, default=20 if gpu else 1)
    ap.add_argument("--engine-warmup", type=int, default=1)
    ap.add_argument("--engine-repeats", type=int, default=5 if gpu else 2)
    ap.add_argument("--naive-max-gb", type=float, default=4.0,
                    help="skip the naive attention where its score tensors need more than this")
    ap.add_argument("--model", choices=["1b", "tiny"], default="1b" if gpu else "tiny")
    ap.add_argument("--dtype", choices=["bfloat16", "float32", "float16"],
                    default="bfloat16" if gpu else "float32")
    ap.add_argument("--engine-backend", choices=["auto", "torch", "triton"], default="auto",
                    help="the engine's attention_backend (auto: triton on CUDA, torch on CPU)")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="the device's dense peak in --dtype for MFU (989: H200 bf16)")
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args(argv)
    args.engine_lengths = args.engine_lengths or args.lengths
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda" if ON_CUDA else "cpu")
    torch.set_grad_enabled(False)
    sections = []
    if not args.skip_attention:
        sections.append(("attention", lambda: bench_attention(args, device,
                                                              getattr(torch, args.dtype))))
    if not args.skip_engine:
        sections.append(("engine", lambda: bench_engine(args, device, args.dtype)))
    failed = []
    for name, run in sections:
        try:  # one lent GPU run should still bring back the other section's numbers
            run()
        except Exception:
            traceback.print_exc()
            failed.append(name)
    if failed:
        sys.exit(f"kernel_bench: section(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
