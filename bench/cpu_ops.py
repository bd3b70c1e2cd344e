"""The CPU choices the engine makes, measured side by side on this machine: the projections
through torch's default matmul (`F.linear`, MKL on x86) against oneDNN (`engine.rank.gemm`), and
a prompt's causal attention through torch's SDPA (its CPU flash kernel, grouped KV heads
shared with `enable_gqa`) against the engine's blocked attention (engine/rank/blocked_attention,
which the engine uses for bf16 prompts). SmolLM2-135M's shapes (hidden 576, FFN 1536, 9 query /
3 KV heads of 64). Also, inside a compiled graph, float32 and bf16 decode rows through oneDNN
against a multiply-and-sum (what the compiled decode graph uses for 1-2 rows), and bf16 decode rows
reading plain weights against weights packed for one row, 30 layers' decode products in one
graph against one graph a layer, and the cost of one call of the decode graph's KV store op.
Prompt attention also runs as compiled flex attention (inductor's CPU template), checked
against SDPA, and as the engine's fused kernel (engine/rank/fused_attention). A decode row's KV
store and attention of one layer, compiled as the decode graph runs them: its tensor math over
the block table against the fused kernel's one call, timed as the engine times them at start-up.
The int8 LM head (every weights=... mode) and the int4 projections (weights="int4"|"gguf") for one
row: torch's `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` against the engine's C++ row
products (engine/rank/quantized_rows). A prompt's products with plain weights against
copies packed for its rows, shape by shape (engine.rank.gemm.PromptCopies), and its gate/up
products with their SiLU·mul as a product and a pass after it against oneDNN's fused halves
(engine.rank.gemm.gated_halves). Runs alternate; the fastest of each is kept.

    .venv/bin/python -m bench.cpu_ops
    .venv/bin/python -m bench.cpu_ops --only-prompt-attention --fused-from REV
    .venv/bin/python -m bench.cpu_ops --only-gated
    .venv/bin/python -m bench.cpu_ops --only-quantized
    .venv/bin/python -m bench.cpu_ops --only-decode-attention
    .venv/bin/python -m bench.cpu_ops --only-prompt-weights

`--fused-from REV` adds the fused kernel as it was at git revision REV (built here the same way)
beside today's, for a before/after in one run.
"""
from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path
from typing import Callable
from unittest import mock

import torch
import torch.nn.functional as F

from bench.common import machine
from engine.rank import fused_attention, ops, quantized_rows
from engine.rank.cpp_library import CppLibrary
from engine.rank.blocked_attention import blocked_causal_attention
from engine.rank import kernel_choice
from engine.rank import gemm
from engine.rank.gemm import linear, onednn_linear
from engine.rank import graph_ops
from engine.rank.kv_cache import KVCache, store_into
from engine.rank.quantized import QuantizedWeight, int4_groups, int8_per_channel

PROJECTIONS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def fastest(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """The best of `repeats` alternating rounds each, after one untimed call: the engine's own
    start-up timer (engine.rank.kernel_choice), held to exactly `repeats` rounds."""
    return kernel_choice.fastest(fns, min_rounds=repeats, min_seconds=0.0, max_rounds=repeats)


def projections(rows: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """One layer's four projections on `rows` tokens; decode (1 row) streams 30 layers' worth
    of distinct weights, as a decode step does, so none come from the cache."""
    layers = 30 if rows == 1 else 1
    weights = [torch.randn(shape, dtype=dtype) for _ in range(layers) for shape in PROJECTIONS]
    inputs = {k: torch.randn(rows, k, dtype=dtype) for k in (576, 1536)}
    flops = sum(2 * rows * w.numel() for w in weights)
    t = fastest({"F.linear": lambda: [F.linear(inputs[w.shape[1]], w) for w in weights],
                 "oneDNN": lambda: [linear(inputs[w.shape[1]], w) for w in weights]}, repeats)
    return {name: flops / s / 1e9 for name, s in t.items()}


def compiled_decode_rows(rows: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """Decode rows (30 layers of distinct weights) inside one compiled graph: oneDNN's inner
    product as an opaque op against the multiply-and-sum inductor streams (engine.rank.gemm
    takes the latter for graphs of at most MATVEC_ROWS fixed float32 or bf16 rows)."""
    weights = [torch.randn(shape, dtype=dtype) for _ in range(30) for shape in PROJECTIONS]
    inputs = {k: torch.randn(rows, k, dtype=dtype) for k in (576, 1536)}
    flops = sum(2 * rows * w.numel() for w in weights)

    def graph(product):
        return torch.compile(lambda: [product(inputs[w.shape[1]], w) for w in weights],
                             dynamic=False)

    t = fastest({"oneDNN op": graph(lambda x, w: onednn_linear(x, w, None)),
                 "multiply-and-sum": graph(lambda x, w: gemm.matvec(x, w, None))}, repeats)
    return {name: flops / s / 1e9 for name, s in t.items()}


def decode_graph_split(dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """GB/s of weight read by one decode row's multiply-and-sum products over 30 layers of
    distinct weights: all in one compiled graph, against one graph a layer called 30 times (as
    the decode step runs its layers: engine.rank.compiled)."""
    weights = [[torch.randn(shape, dtype=dtype) for shape in PROJECTIONS] for _ in range(30)]
    x = {k: torch.randn(1, k, dtype=dtype) for k in (576, 1536)}
    nbytes = sum(w.nbytes for layer in weights for w in layer)

    def products(layer: list[torch.Tensor]) -> list[torch.Tensor]:
        return [gemm.matvec(x[w.shape[1]], w, None) for w in layer]

    one_graph = torch.compile(lambda: [products(layer) for layer in weights], dynamic=False)
    a_layer = torch.compile(products, dynamic=False)
    t = fastest({"one graph": one_graph,
                 "a graph a layer": lambda: [a_layer(layer) for layer in weights]}, repeats)
    return {name: nbytes / s / 1e9 for name, s in t.items()}


def packed_decode_rows(rows: int, repeats: int) -> dict[str, float]:
    """bf16 decode rows (30 layers of distinct weights) through oneDNN, each weight plain against
    packed for one row (what a bf16 model's decode steps read where the start-up timing finds it
    faster: engine.rank.decode_weights). GB/s of weight read."""
    weights = [torch.randn(shape, dtype=torch.bfloat16) for _ in range(30) for shape in PROJECTIONS]
    packed = [gemm.pack_for_rows(w, 1) for w in weights]
    inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (576, 1536)}
    nbytes = sum(w.nbytes for w in weights)
    t = fastest({"plain": lambda: [linear(inputs[w.shape[1]], w) for w in weights],
                 "packed": lambda: [linear(inputs[w.shape[1]], p) for w, p in zip(weights, packed)]},
                repeats)
    return {name: nbytes / s / 1e9 for name, s in t.items()}


def prompt_copies(rows: int, dtype: torch.dtype, shape: tuple[int, int],
                  repeats: int) -> dict[str, float]:
    """A prompt's rows through 30 layers' projections of one shape (distinct weights) by
    oneDNN, each weight plain (reordered inside every product) against a copy packed once for
    those rows (what prompts read where the start-up timing finds it faster, shape by shape:
    engine.rank.gemm.PromptCopies). GFLOP/s."""
    weights = [torch.randn(shape, dtype=dtype) for _ in range(30)]
    packed = [gemm.pack_for_rows(w, rows) for w in weights]
    x = torch.randn(rows, shape[1], dtype=dtype)
    flops = sum(2 * rows * w.numel() for w in weights)
    product = gemm.eager_onednn_linear
    t = fastest({"plain": lambda: [product(x, w) for w in weights],
                 "packed": lambda: [product(x, p) for p in packed]}, repeats)
    return {name: flops / s / 1e9 for name, s in t.items()}


def gated_products(rows: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """A prompt's rows through 30 layers' gate/up products (distinct weights) with their
    SiLU·mul: on the plain weights, torch's product ("torch", MKL for float32) and oneDNN's
    ("plain"), then the SiLU·mul; oneDNN on copies packed whole, then the SiLU·mul ("whole");
    packed halves with the SiLU and the product applied by oneDNN as it writes ("halves",
    engine.rank.gemm.gated_halves). Checked to agree first. GFLOP/s of the products."""
    weights = [torch.randn(PROJECTIONS[2], dtype=dtype) / 8 for _ in range(30)]
    whole = [gemm.pack_for_rows(w, rows) for w in weights]
    halves = [gemm.pack_halves(w, rows) for w in weights]
    x = torch.randn(rows, PROJECTIONS[2][1], dtype=dtype)
    fns = {"torch": lambda: [ops.silu_mul(F.linear(x, w)) for w in weights],
           "plain": lambda: [ops.silu_mul(gemm.eager_onednn_linear(x, w)) for w in weights],
           "whole": lambda: [ops.silu_mul(gemm.eager_onednn_linear(x, w)) for w in whole],
           "halves": lambda: [gemm.gated_halves(x, *h) for h in halves]}
    a = fns["torch"]()[0].float()
    for name in ("plain", "whole", "halves"):
        torch.testing.assert_close(fns[name]()[0].float(), a, rtol=0,
                                   atol=2e-2 * a.abs().max().item())
    flops = sum(2 * rows * w.numel() for w in weights)
    return {name: flops / s / 1e9 for name, s in fastest(fns, repeats).items()}


def gated(args: argparse.Namespace) -> None:
    names = ("torch", "plain", "whole", "halves")
    print(f"{'gate/up + SiLU·mul GFLOP/s':<27}" + "".join(f"{n:>9}" for n in names)
          + f"{'halves / plain':>16}")
    for dtype in (d for d in args.dtypes if gemm.onednn_runs(getattr(torch, d))):
        for rows in (512, 2048):
            r = gated_products(rows, getattr(torch, dtype), max(2, args.repeats // 3))
            print(f"{f'{dtype}, {rows} rows':<27}" + "".join(f"{r[n]:>9.1f}" for n in names)
                  + f"{r['halves'] / r['plain']:>15.2f}x")


def fused_attention_with(library) -> Callable[..., torch.Tensor]:
    """fused_attention.causal_attention running `library`'s kernels (the swap costs ~3 us a
    call, so a before/after runs both kernels through it)."""
    def causal_attention(*args) -> torch.Tensor:
        with mock.patch.object(fused_attention, "_kernels", lambda: library):
            return fused_attention.causal_attention(*args)
    return causal_attention


def fused_attention_at(rev: str) -> Callable[..., torch.Tensor]:
    """fused_attention.causal_attention running the kernels as they were at git revision `rev`,
    built here as the engine builds today's (for this CPU, in a temporary folder)."""
    folder = Path(tempfile.mkdtemp(prefix="fused-attention-"))
    for name in ("fused_attention.cpp", "cpu_vectors.h", "torch_ops.h"):
        shown = subprocess.run(["git", "show", f"{rev}:engine/rank/{name}"], capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parents[1])
        if shown.returncode == 0:  # (torch_ops.h came later than the others)
            (folder / name).write_text(shown.stdout)
    # built against torch where it includes its headers (it registers torch ops: not called
    # here, the process has today's); only the prompt kernel is looked up
    prompt = {"fused_causal_attention": fused_attention.LIBRARY.signatures["fused_causal_attention"]}
    registers = "register_ops" in (folder / "fused_attention.cpp").read_text()
    then = CppLibrary(folder / "fused_attention.cpp", f"fused attention at {rev}", prompt, "",
                      register="register_ops" if registers else None)
    return fused_attention_with(then.open(then.build(folder, "g++")))


def attention(q_len: int, kv_len: int, dtype: torch.dtype, repeats: int,
              fused_then: Callable[..., torch.Tensor] | None = None) -> dict[str, float]:
    """The last q_len queries of a kv_len context (q_len < kv_len: a chunk after a prefix):
    torch's SDPA, the engine's blocked attention, compiled flex attention (inductor's CPU
    template) with a block mask of the same causal pattern, checked against SDPA, and the
    engine's fused kernel (where it is built), and as `fused_then` runs it (fused_attention_at),
    checked against today's."""
    q = torch.randn(q_len, HEADS, HEAD_DIM, dtype=dtype)
    k, v = (torch.randn(kv_len, KV_HEADS, HEAD_DIM, dtype=dtype) for _ in range(2))
    mask = None if q_len == kv_len else (
        torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None])
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    sdpa = lambda: F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,  # noqa: E731
                                                  is_causal=mask is None, enable_gqa=True)
    flex = _flex_attention(qs, ks, vs)
    # bf16 outputs of softmax-weighted means agree to a few bf16 ulps of the values' scale
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(flex(), sdpa(), atol=tolerance, rtol=0)
    candidates = {"SDPA": sdpa, "flex": flex,
                  "blocked": lambda: blocked_causal_attention(q, k, v, HEAD_DIM ** -0.5)}
    if dtype in fused_attention.DTYPES and fused_attention.available():
        candidates["fused"] = lambda: fused_attention.causal_attention(q, k, v, HEAD_DIM ** -0.5)
    t = fastest(candidates, repeats)
    if fused_then is not None and "fused" in candidates:
        # the two builds timed by themselves, each after the other: among the rest, the one
        # timed after the blocked kernel started from other caches than the one after it (this
        # command, --fused-from 5a73958 on the AMX Xeon: a float32 kernel the same in both
        # builds timed 1.46x slower so at 128 tokens)
        now = fused_attention_with(fused_attention.LIBRARY.get())  # the same swap as `then`'s
        builds = {"fused": lambda: now(q, k, v, HEAD_DIM ** -0.5),
                  "fused then": lambda: fused_then(q, k, v, HEAD_DIM ** -0.5)}
        torch.testing.assert_close(builds["fused then"](), builds["fused"](), atol=tolerance,
                                   rtol=0)
        t.update(fastest(builds, repeats))
    return {name: s * 1e3 for name, s in t.items()}


def _flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Compiled flex attention of q [1, hq, q_len, d] over k/v [1, hkv, kv_len, d], the queries
    at the context's last q_len positions."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q_len, kv_len = q.shape[2], k.shape[2]
    block_mask = create_block_mask(lambda b, h, qi, ki: qi + (kv_len - q_len) >= ki, 1, 1,
                                   q_len, kv_len, device="cpu")
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda: compiled(q, k, v, block_mask=block_mask, enable_gqa=True)


def kv_store_calls(repeats: int, calls: int = 1000) -> dict[str, float]:
    """Microseconds per call of the decode graph's KV store (one row of SmolLM2's K/V) as the
    engine defines it (parallel.graph_op, through torch.library.Library) and as the same
    function under torch.library.custom_op, which the engine used before."""
    cache = KVCache(2, 4, 16, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    k, v, slots = torch.randn(1, KV_HEADS, HEAD_DIM), torch.randn(1, KV_HEADS, HEAD_DIM), \
        torch.tensor([5])

    @torch.library.custom_op("bench::kv_store", mutates_args=("cache",))
    def decorated(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, layer: int,
                  slot_mapping: torch.Tensor) -> None:
        store_into(cache, layer, k, v, slot_mapping)

    def loop(op: Callable) -> Callable[[], None]:
        return lambda: [op(k, v, cache.data, 1, slots) for _ in range(calls)]

    times = fastest({"graph_op": loop(graph_ops.kv_store), "custom_op": loop(decorated)},
                    repeats)
    return {name: seconds / calls * 1e6 for name, seconds in times.items()}


def decode_graph_attention(keys: int, dtype: torch.dtype) -> dict[str, float]:
    """Microseconds for one decode row's KV store and attention over `keys` keys, each way the
    decode graph can run them, compiled (engine.rank.kernel_choice's own start-up timing)."""
    times = kernel_choice._time_decode_in_graph((HEADS, KV_HEADS, HEAD_DIM), 16, keys, dtype)
    return {name: s * 1e6 for name, s in times.items()}


def quantized_row(weight: QuantizedWeight) -> dict[str, float]:
    """GB/s of codes and scales read by one row through `weight`, torch's kernel against the
    engine's, over copies that outgrow the caches (engine.rank.kernel_choice's own timing)."""
    times = kernel_choice._time_linear({"torch": gemm.linear, "fused": quantized_rows.linear},
                                       weight, 1)
    return {name: weight.nbytes / s / 1e9 for name, s in times.items()}


def quantized(args: argparse.Namespace) -> None:
    """SmolLM2's int8 LM head [49152, 576], and its projections as int4 groups."""
    dtypes = [d for d in args.dtypes if getattr(torch, d) in quantized_rows.DTYPES]
    weights = {"int8": [("LM head", int8_per_channel, (49152, 576))],
               "int4": [(name, int4_groups, shape) for name, shape in
                        zip(("qkv", "o", "gate_up", "down"), PROJECTIONS)]}
    for kind, rows in weights.items():
        if not quantized_rows.available(kind):
            print(f"{kind}: the engine's row product is not built here")
            continue
        _table_row(f"{kind}, 1 row", "torch GB/s", "fused GB/s", "fused / torch")
        for dtype in dtypes:
            for name, quantize, shape in rows:
                r = quantized_row(quantize(torch.randn(shape).to(getattr(torch, dtype))))
                _table_row(f"{dtype}, {name}", r["torch"], r["fused"], r["fused"] / r["torch"])


def _table_row(label: str, first, second, ratio) -> None:
    """A row of two figures and their ratio (or, given strings, the header of such rows)."""
    if isinstance(first, str):
        print(f"{label:<24} {first:>17} {second:>15} {ratio:>18}")
    else:
        print(f"{label:<24} {first:>17.1f} {second:>15.1f} {ratio:>17.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--only-prompt-attention", action="store_true")
    ap.add_argument("--only-gated", action="store_true",
                    help="only the gate/up products with their SiLU·mul, fused and not")
    ap.add_argument("--only-quantized", action="store_true",
                    help="only the quantized weights' one-row products, torch's and the engine's")
    ap.add_argument("--only-decode-attention", action="store_true",
                    help="only a decode row's attention per layer, tensor math and fused kernel")
    ap.add_argument("--only-prompt-weights", action="store_true",
                    help="only each projection shape's prompt products, plain and packed")
    ap.add_argument("--fused-from", metavar="REV",
                    help="time the fused prompt attention as it was at this git revision too")
    args = ap.parse_args()
    # the same functions compile once per shape and dtype here: more than dynamo's default 8
    # graphs of one function, past which it would run the rest eagerly, unreported
    torch._dynamo.config.recompile_limit = 64
    print(f"{machine()}; best of {args.repeats}, alternating")
    if args.only_gated:
        return gated(args)
    if args.only_quantized:
        return quantized(args)
    if args.only_decode_attention:
        return decode_attention(args)
    if args.only_prompt_weights:
        return prompt_weights(args)
    if not args.only_prompt_attention:
        other_ops(args)
        gated(args)
    prompt_attention(args)


def other_ops(args: argparse.Namespace) -> None:
    print(f"{'projections':<24} {'F.linear GFLOP/s':>17} {'oneDNN GFLOP/s':>15} {'oneDNN / F.linear':>18}")
    for dtype in args.dtypes:
        for rows in (1, 128, 2048):
            r = projections(rows, getattr(torch, dtype), args.repeats)
            print(f"{dtype + f', {rows} rows':<24} {r['F.linear']:>17.1f} {r['oneDNN']:>15.1f} "
                  f"{r['oneDNN'] / r['F.linear']:>17.2f}x")
    print(f"{'compiled decode rows':<24} {'oneDNN op GFLOP/s':>17} {'mul-sum GFLOP/s':>15} {'mul-sum / oneDNN':>18}")
    for dtype in (d for d in args.dtypes if gemm.onednn_runs(getattr(torch, d))):
        for rows in (1, 2, 4, 8):
            r = compiled_decode_rows(rows, getattr(torch, dtype), args.repeats)
            print(f"{dtype + f', {rows} rows':<24} {r['oneDNN op']:>17.1f} "
                  f"{r['multiply-and-sum']:>15.1f} {r['multiply-and-sum'] / r['oneDNN op']:>17.2f}x")
    print(f"{'decode products, 1 row':<24} {'one graph GB/s':>17} {'per layer GB/s':>15} {'one / per layer':>18}")
    for dtype in (d for d in args.dtypes if gemm.onednn_runs(getattr(torch, d))):
        r = decode_graph_split(getattr(torch, dtype), args.repeats)
        print(f"{dtype:<24} {r['one graph']:>17.1f} {r['a graph a layer']:>15.1f} "
              f"{r['one graph'] / r['a graph a layer']:>17.2f}x")
    if "bfloat16" in args.dtypes and not gemm.HAVE_ONEDNN_BF16:
        print("bf16 decode weights: not offered on this CPU (oneDNN builds no bf16 products)")
    elif "bfloat16" in args.dtypes:
        print(f"{'bf16 decode weights':<24} {'plain GB/s':>17} {'packed GB/s':>15} {'packed / plain':>18}")
        for rows in (1, 4):
            r = packed_decode_rows(rows, args.repeats)
            print(f"{f'bfloat16, {rows} rows':<24} {r['plain']:>17.1f} {r['packed']:>15.1f} "
                  f"{r['packed'] / r['plain']:>17.2f}x")
    prompt_weights(args)
    r = kv_store_calls(args.repeats)
    print(f"{'KV store op, us a call':<24} {'custom_op':>17} {'graph_op':>15} {'custom / graph':>18}")
    print(f"{'one decode row':<24} {r['custom_op']:>17.1f} {r['graph_op']:>15.1f} "
          f"{r['custom_op'] / r['graph_op']:>17.2f}x")
    decode_attention(args)
    quantized(args)


def prompt_weights(args: argparse.Namespace) -> None:
    """Each projection shape's prompt products from plain weights and from packed copies."""
    _table_row("prompt weights", "plain GFLOP/s", "packed GFLOP/s", "packed / plain")
    for dtype in (d for d in args.dtypes if gemm.onednn_runs(getattr(torch, d))):
        for rows in (512, 2048):
            for shape in PROJECTIONS:
                r = prompt_copies(rows, getattr(torch, dtype), shape, max(2, args.repeats // 3))
                short = {"float32": "f32", "bfloat16": "bf16"}[dtype]
                _table_row(f"{short}, {rows} rows, {shape[0]}x{shape[1]}", r["plain"],
                           r["packed"], r["packed"] / r["plain"])


def decode_attention(args: argparse.Namespace) -> None:
    """A decode row's KV store and attention over 256-4096 keys, per layer: the decode graph's
    tensor math against the fused kernel."""
    if not fused_attention.available():
        print("decode graph attention: the fused kernel is not built here")
        return
    _table_row("decode graph attention", "tensor math us", "fused us", "tensor / fused")
    for dtype in (d for d in args.dtypes if getattr(torch, d) in fused_attention.DTYPES):
        for keys in (256, 1024, 4096):
            r = decode_graph_attention(keys, getattr(torch, dtype))
            _table_row(f"{dtype}, {keys} keys", r["tensor-math"], r["fused"],
                       r["tensor-math"] / r["fused"])


def prompt_attention(args: argparse.Namespace) -> None:
    then = fused_attention_at(args.fused_from) if args.fused_from else None
    columns = f"{'fused then ms':>14} {'then / fused':>13} " if then else ""
    print(f"{'prompt attention q/kv':<24} {'SDPA ms':>9} {'blocked ms':>11} {'flex ms':>9} "
          f"{'fused ms':>9} {columns}{'fastest':>8}")
    for dtype in args.dtypes:
        for q_len, kv_len in ((128, 128), (512, 512), (2048, 2048), (512, 2048)):
            r = attention(q_len, kv_len, getattr(torch, dtype), args.repeats, then)
            fused = r.get("fused", float("nan"))
            before = (f"{r['fused then']:>14.3f} {r['fused then'] / fused:>12.2f}x "
                      if "fused then" in r else "")
            print(f"{dtype + f', {q_len}/{kv_len}':<24} {r['SDPA']:>9.3f} {r['blocked']:>11.3f} "
                  f"{r['flex']:>9.3f} {fused:>9.3f} {before}{min(r, key=r.get):>8}")


if __name__ == "__main__":
    main()
