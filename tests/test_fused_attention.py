"""engine.rank.fused_attention, the CPU attention built from C++ on this machine, against a
float64 softmax(QKᵀ)V with an explicit causal mask: whole prompts and chunks after cached keys,
grouped and ungrouped heads, every head size it is built for, lengths that are not multiples of
its tiles, strided rows as the QKV projection's views give it, one thread and two, float32 and
bfloat16 (its float32 arithmetic on bf16 inputs: within the output's bf16 rounding), scores that
climb or fall far along the keys (moving its lazily kept running max), and the code an AVX2-only
CPU runs, built here for that kind of CPU. Inputs it does not take, and a machine where it cannot
be built, get SDPA's answer; an engine where it wins the timing runs it in every layer of a
prompt and gives the tokens of the built-in choice."""
from __future__ import annotations

import pytest
import torch

from engine.rank import fused_attention as fa
from engine.rank import kernel_choice as kc
from tests.cpu_features import run_in_a_build_for
from tests.engine_cache import fresh_cache
from tests.op_calls import op_calls
from tests.reference import causal_attention_float64


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    # one build for the module's tests (not the user's cache); kernel choices time afresh
    monkeypatch.setenv("PREFILL_ENGINE_CACHE",
                       str(fresh_cache(tmp_path_factory.getbasetemp() / "fused")))


# float32 to its rounding (the float64 reference sums in another order); bf16 outputs within a
# rounding of bf16 (2^-8 relative) of values of magnitude up to ~3
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


def _qkv(q_len: int, kv_len: int, heads: int, kv_heads: int, d: int, seed: int,
         dtype: torch.dtype = torch.float32):
    """q, k, v as views of one [kv_len, (heads + 2 kv_heads) d] buffer, as the QKV projection's
    output is split: strided rows, contiguous heads."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(kv_len, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    q = qkv[kv_len - q_len:, :heads * d].view(q_len, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(kv_len, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(kv_len, kv_heads, d)
    return q, k, v


def test_it_builds_here():
    """CI's machines have g++: a build failure here is a bug, not a fallback."""
    assert fa.available()


@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (2, 2), (37, 37), (300, 300), (5, 41),
                                          (130, 400), (17, 129)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", fa.DTYPES)
def test_matches_float64(q_len, kv_len, heads, kv_heads, threads, dtype):
    q, k, v = _qkv(q_len, kv_len, heads, kv_heads, 64, seed=q_len * 1000 + kv_len + heads,
                   dtype=dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = fa.causal_attention(q, k, v, 0.125)
    finally:
        torch.set_num_threads(before)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), causal_attention_float64(q, k, v, 0.125),
                               atol=TOLERANCE[dtype], rtol=0)


def _climbing(q_len: int, kv_len: int, slope: float, dtype: torch.dtype, seed: int):
    """q, k, v (6 query heads on 2 KV heads, d 64) whose scores climb along the keys by about
    `slope` (after the 1/8 scale) per key: every query leans on one direction u and key j on
    j slope u, over random noise. Falling scores (slope < 0) leave the max in the first tile."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(64, generator=gen, dtype=torch.float64), dim=0)
    keys = torch.randn(kv_len, 2, 64, generator=gen, dtype=torch.float64)
    keys += torch.arange(kv_len, dtype=torch.float64)[:, None, None] * slope * u
    q = torch.randn(q_len, 6, 64, generator=gen, dtype=torch.float64) + 8 * u
    v = torch.randn(kv_len, 2, 64, generator=gen, dtype=torch.float64)
    return q.to(dtype), keys.to(dtype), v.to(dtype)


@pytest.mark.parametrize("slope", [-0.5, 0.002, 0.05, 0.5])
@pytest.mark.parametrize("dtype", fa.DTYPES)
def test_scores_that_climb_or_fall_along_the_keys(slope, dtype):
    """The kernel's running max moves only when a tile's scores pass it by more than 2^8
    (fused_attention.cpp, RESCALE_ABOVE): here scores climb by ~0.3, ~7 and ~70 powers of 2
    per tile of 128 keys (kept, kept then moved, moved at every tile), or fall (probabilities
    underflowing to 0 far from the first keys); the scores span up to ~1000 in all."""
    q, k, v = _climbing(200, 600, slope, dtype, seed=int(abs(slope) * 1000))
    out = fa.causal_attention(q, k, v, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), causal_attention_float64(q, k, v, 0.125),
                               atol=_climbing_tolerance(q, k, v, dtype), rtol=0)


def _climbing_tolerance(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        dtype: torch.dtype) -> float:
    """TOLERANCE, plus what rounding scores of this size costs: a float32 score is rounded to
    its own size, so e^score's relative error grows with it."""
    scores = torch.einsum("qhd,khd->qhk", q.double(), k.double().repeat_interleave(3, 1)) * 0.125
    return TOLERANCE[dtype] + 4 * 2.0 ** -23 * float(scores.abs().max()) * float(v.abs().max())


@pytest.mark.parametrize("d", fa.HEAD_DIMS)
@pytest.mark.parametrize("dtype", fa.DTYPES)
def test_every_head_size_it_is_built_for(d, dtype):
    q, k, v = (t.contiguous() for t in _qkv(50, 200, 6, 2, d, seed=d, dtype=dtype))
    torch.testing.assert_close(fa.causal_attention(q, k, v, d ** -0.5).double(),
                               causal_attention_float64(q, k, v, d ** -0.5),
                               atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="this CPU cannot run code built for AVX2")
def test_the_build_for_an_avx2_only_cpu_matches_float64(tmp_path):
    """The code an AVX2-only CPU (as our EPYC without AVX512) runs: 8-wide vectors, lanes as
    integer vectors instead of mask registers, 2^n from exponent bits, bf16 widened. Built here
    for that kind of CPU (-march=x86-64-v3) and run on this one: prompts (scores that climb,
    moving the running max) and decode steps (the op's kernel, which the process registers from
    its one build: so in a process of its own), float32 and bf16."""
    _runs_in_a_build_for("x86-64-v3", tmp_path, "_avx2_build_matches_float64")


def _runs_in_a_build_for(march: str, tmp_path, check: str) -> None:
    """This module's function `check`, run to its end in a process whose kernels are built for
    `march` (a process registers one build's op kernels)."""
    out = run_in_a_build_for(march, tmp_path, (
        f"from tests.test_fused_attention import {check}\n{check}()\nprint('checked')\n"))
    assert out.split() == ["checked"]


def _avx2_build_matches_float64() -> None:
    assert fa.available()
    for dtype in fa.DTYPES:
        _climbing_matches_float64(37, 300, dtype, seed=3)
        q, k, v, cache, slots, table, lens = _paged(3, 9, 3, 64, 16, [600, 1, 257], dtype, seed=5)
        want_cache, want = _paged_reference(q, k, v, cache, slots, table, lens, 1, 0.125)
        out = fa.paged_decode(q, k, v, cache, 1, slots, table, lens, 0.125)
        assert torch.equal(cache, want_cache)
        torch.testing.assert_close(out.double(), want, atol=TOLERANCE[dtype], rtol=0)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next(line for line in f if line.startswith("flags")).split(":")[1].split())


AMX = {"amx_tile", "amx_bf16"} <= _cpu_flags()


@pytest.mark.skipif(not AMX, reason="this CPU has no AMX (the tests above ran its other path)")
def test_an_amx_cpu_multiplies_bf16_in_tiles_and_a_build_without_amx_still_agrees(tmp_path):
    """On a CPU with AMX the tests above ran bf16 prompts through AMX tiles; the AVX512-BF16 pair
    dot products that such a CPU without AMX runs (Cooper Lake's build, as an EPYC's) are
    checked here against float64 too, with the scores that move the running max."""
    assert fa.bf16_products() == "AMX tiles"
    assert fa.bf16_products(16) == "AVX512-BF16 pair dot products"  # heads not of whole tiles
    _runs_in_a_build_for("cooperlake", tmp_path, "_pairs_build_matches_float64")


def _pairs_build_matches_float64() -> None:
    assert fa.bf16_products() == "AVX512-BF16 pair dot products"
    _climbing_matches_float64(37, 300, torch.bfloat16, seed=3)
    _climbing_matches_float64(300, 300, torch.bfloat16, seed=4)


def _climbing_matches_float64(q_len: int, kv_len: int, dtype: torch.dtype, seed: int) -> None:
    """A prompt whose scores climb along the keys (moving the running max) against float64."""
    q, k, v = _climbing(q_len, kv_len, 0.05, dtype, seed=seed)
    torch.testing.assert_close(fa.causal_attention(q, k, v, 0.125).double(),
                               causal_attention_float64(q, k, v, 0.125),
                               atol=_climbing_tolerance(q, k, v, dtype), rtol=0)


def test_the_amx_code_builds_for_an_amx_cpu(tmp_path):
    """What a Xeon with AMX runs, compiled on any machine (the tests above run it only where
    the CPU has AMX): a build for Sapphire Rapids."""
    assert fa.LIBRARY.build(tmp_path, "g++", march="sapphirerapids").exists()


def test_bf16_outputs_round_to_nearest():
    """bf16 outputs are rounded to the nearest bf16, not truncated: over many outputs the
    signed error relative to float64 averages ~0 (truncation would shrink every one, by half
    a bf16 step on average: -0.2 %)."""
    q, k, v = _qkv(256, 256, 8, 2, 64, seed=11, dtype=torch.bfloat16)
    ref = causal_attention_float64(q, k, v, 0.125)
    out = fa.causal_attention(q, k, v, 0.125).double()
    large = ref.abs() > 0.05
    shrink = ((out - ref) * ref.sign() / ref.abs())[large]
    assert large.sum() > 10_000 and abs(shrink.mean()) < 3e-4


@pytest.mark.parametrize("case", ["head size 24", "float16", "more queries than keys",
                                  "values of another dtype"])
def test_inputs_it_does_not_take_get_sdpas_answer(case):
    q, k, v = _qkv(20, 30, 6, 2, 24 if case == "head size 24" else 32, seed=7)
    if case == "float16":
        q, k, v = (t.to(torch.float16) for t in (q, k, v))
    if case == "values of another dtype":
        v = v.double()
    if case == "more queries than keys":
        q = torch.cat([q, q])[:35]
    assert not fa.supports(q, k, v)
    if case in ("more queries than keys", "values of another dtype"):
        return  # not attention the engine asks for: what SDPA does with it is SDPA's business
    out = fa.causal_attention(q, k, v, 0.2)
    tol = 3e-3 if q.dtype == torch.float16 else 2e-6
    torch.testing.assert_close(out.double(), causal_attention_float64(q, k, v, 0.2),
                               atol=tol, rtol=0)


def test_heads_that_are_not_side_by_side_are_copied_not_misread():
    """One KV head broadcast to two (stride 0 between heads), and queries in head-major memory."""
    q, k, v = _qkv(40, 40, 4, 1, 32, seed=9)
    k, v = k.expand(-1, 2, -1), v.expand(-1, 2, -1)
    q = q.transpose(0, 1).contiguous().transpose(0, 1)
    torch.testing.assert_close(fa.causal_attention(q, k, v, 0.2).double(),
                               causal_attention_float64(q, k, v, 0.2), atol=2e-6, rtol=0)


def test_a_machine_without_a_compiler_keeps_sdpa(monkeypatch, tmp_path, caplog):
    """No compiler: one warning, no "fused" candidate, and the function still answers (SDPA)."""
    monkeypatch.setattr(fa.LIBRARY, "_loaded", [])
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert not fa.available()
    assert "unavailable" in caplog.text and "no C++ compiler" in caplog.text
    assert "fused" not in kc.attention_kernels(torch.float32)
    assert "fused" not in kc.attention_kernels(torch.bfloat16)
    q, k, v = _qkv(20, 20, 4, 2, 32, seed=8)
    torch.testing.assert_close(fa.causal_attention(q, k, v, 0.2).double(),
                               causal_attention_float64(q, k, v, 0.2), atol=2e-6, rtol=0)
    assert not list(tmp_path.glob("kernels/*"))  # nothing half-built left


def test_a_compiler_that_fails_keeps_sdpa(monkeypatch, tmp_path, caplog):
    """A compiler that cannot build it (here `false`): one warning naming it, nothing left."""
    monkeypatch.setattr(fa.LIBRARY, "_loaded", [])
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    assert not fa.available()
    assert "unavailable" in caplog.text and "false --version failed" in caplog.text
    assert not list(tmp_path.glob("kernels/*"))


def _fused_wins_every_prompt_bucket(monkeypatch, tmp_path) -> list[tuple[int, int]]:
    """The fused kernel made to win every prompt bucket's timing (nothing timed before); the
    (queries, keys) of each of its calls from then on are appended to the list returned."""
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(fresh_cache(tmp_path)))
    timed = kc._time_attention
    monkeypatch.setattr(kc, "_time_attention", lambda heads, tokens, dtype, kernels, queries=None: (
        {"sdpa": 3e-3, "blocked": 3e-3, "fused": 1e-3} if queries is None
        else timed(heads, tokens, dtype, kernels, queries)))
    real, calls = fa.causal_attention, []
    monkeypatch.setattr(fa, "causal_attention",
                        lambda q, k, *rest: calls.append((len(q), len(k))) or real(q, k, *rest))
    return calls


@pytest.mark.parametrize("compile", [False, True])
def test_an_engine_where_it_wins_runs_it_and_keeps_the_tokens(tiny_model_dir, monkeypatch,
                                                              tmp_path, compile):
    """The fused kernel made to win every prompt bucket: each layer of each prompt step runs it
    (eagerly and through the compiled prompt graph's attention op), over the whole prompt and
    over a chunk after a prefix-cache hit, and the greedy tokens are those of the built-in
    choice (SDPA)."""
    import json

    from engine import LLM, SamplingParams

    calls = _fused_wins_every_prompt_bucket(monkeypatch, tmp_path)
    path = tiny_model_dir("llama")
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    prompt = [(7 * i) % 200 + 3 for i in range(40)]
    tokens = {}
    for choice in ("measure", "fixed"):
        with LLM(str(path), kernel_choice=choice, compile=compile, block_size=16) as llm:
            calls.clear()
            tokens[choice] = [llm.generate([p], SamplingParams(max_tokens=4))[0].token_ids
                              for p in (prompt, prompt + [9, 8, 7])]
            if choice == "measure":
                [info] = llm.rank_info()
                picked = list(calls)
    assert any(line.startswith("attention") and ": fused (" in line for line in info.kernels)
    # the first prompt whole; the second's last 11 tokens after its 32 cached ones
    assert picked == [(40, 40)] * layers + [(11, 43)] * layers
    assert calls == []  # the built-in choice never runs it
    assert tokens["measure"] == tokens["fixed"]


def test_a_bf16_engine_where_it_wins_is_as_near_float32_as_the_built_in(smollm2_path,
                                                                         monkeypatch, tmp_path):
    """bf16 SmolLM2 (heads of 64: AMX tiles where the CPU has them, run between oneDNN's bf16
    projections, which on such a CPU use the same tile registers; each kernel sets the tiles'
    shapes it needs): every layer of a prompt runs the fused kernel where it wins, its pick says
    how it multiplies, and the prompt's log-probabilities lie as near the float32 engine's as
    the built-in bf16 attention's do. Greedy tokens are no test in bf16 here: SmolLM2's top two
    logits on this prompt differ by as little as one or two bf16 steps."""
    from engine import LLM

    calls = _fused_wins_every_prompt_bucket(monkeypatch, tmp_path)
    prompt = [(7 * i) % 200 + 3 for i in range(43)]
    logprobs = {}
    for name, dtype, choice in (("float32", "float32", "fixed"), ("fused", "bfloat16", "measure"),
                                ("built-in", "bfloat16", "fixed")):
        with LLM(smollm2_path, kernel_choice=choice, compile=False, dtype=dtype) as llm:
            calls.clear()
            logprobs[name] = torch.tensor(llm.score([prompt])[0].logprobs, dtype=torch.float64)
            if name == "fused":
                [info], picked = llm.rank_info(), list(calls)
    how = f"fused [bf16 products in {fa.bf16_products(64)}] ("
    assert any(line.startswith("attention") and how in line for line in info.kernels)
    assert picked == [(43, 43)] * 30  # SmolLM2-135M's layers
    error = {name: float((logprobs[name] - logprobs["float32"]).abs().mean())
             for name in ("fused", "built-in")}
    assert error["fused"] <= 1.5 * error["built-in"] + 0.01, error


# ---- a decode step over the paged cache (fused_attention.paged_decode) ----

def _paged(rows: int, heads: int, kv_heads: int, d: int, block: int, lengths: list[int],
           dtype: torch.dtype, seed: int):
    """A one-layer-of-two cache ([k|v, layer, block, slot, hkv, d]) of random values, each row's
    blocks out of order (no block shared: every row stores its own new token), the new token's
    slot at its context's end; q, k, v as views of one QKV buffer (strided rows)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block) for n in lengths)
    num_blocks = rows * width + 3
    cache = torch.randn(2, 2, num_blocks, block, kv_heads, d, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)[:rows * width].view(rows, width)
    table = order.to(torch.int32)
    slots = torch.tensor([int(table[r, (n - 1) // block]) * block + (n - 1) % block
                          for r, n in enumerate(lengths)], dtype=torch.int32)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    q = qkv[:, :heads * d].view(rows, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(rows, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(rows, kv_heads, d)
    return q, k, v, cache, slots, table, torch.tensor(lengths, dtype=torch.int32)


def _paged_reference(q, k, v, cache, slots, table, lengths, layer, scale):
    """The cache with k, v written at their slots (plain indexing), and each row's query over
    its context read block by block, in float64."""
    want = cache.clone()
    block = cache.shape[3]
    for r, slot in enumerate(slots.tolist()):
        want[0, layer, slot // block, slot % block] = k[r]
        want[1, layer, slot // block, slot % block] = v[r]
    out = []
    for r, n in enumerate(lengths.tolist()):
        keys = torch.cat([want[0, layer, b] for b in table[r].tolist()])[:n]
        values = torch.cat([want[1, layer, b] for b in table[r].tolist()])[:n]
        out.append(causal_attention_float64(q[r:r + 1], keys, values, scale)[0])
    return want, torch.stack(out)


@pytest.mark.parametrize("lengths,block", [([1], 16), ([16], 16), ([300], 16), ([600, 1, 257], 16),
                                           ([37, 5], 5), ([513], 7)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", fa.DTYPES)
def test_paged_decode_stores_then_matches_float64(lengths, block, heads, kv_heads, threads,
                                                  dtype):
    """Contexts of one token, one whole block, many blocks, several spans of the kernel's
    work split (DECODE_KEYS, 128 keys), spans of an odd count of keys (bf16 values go in pairs
    of keys), rows of different lengths, block sizes that are not powers of two: the cache
    afterwards is the old one with exactly the new K/V written, and each output is the float64
    attention over its row's blocks."""
    q, k, v, cache, slots, table, lens = _paged(len(lengths), heads, kv_heads, 32, block,
                                                lengths, dtype, seed=sum(lengths) + heads)
    want_cache, want = _paged_reference(q, k, v, cache, slots, table, lens, 1, 0.3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = fa.paged_decode(q, k, v, cache, 1, slots, table, lens, 0.3)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(cache, want_cache)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out.double(), want, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("d", fa.HEAD_DIMS)
@pytest.mark.parametrize("dtype", fa.DTYPES)
def test_paged_decode_every_head_size(d, dtype):
    q, k, v, cache, slots, table, lens = _paged(2, 4, 2, d, 8, [45, 20], dtype, seed=d)
    want_cache, want = _paged_reference(q, k, v, cache, slots, table, lens, 0, d ** -0.5)
    out = fa.paged_decode(q, k, v, cache, 0, slots, table, lens, d ** -0.5)
    assert torch.equal(cache, want_cache)
    torch.testing.assert_close(out.double(), want, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("damage", ["slot past the cache", "negative slot", "block id past the cache",
                                    "empty context", "context past the table"])
def test_paged_decode_refuses_indexes_outside_the_cache_and_writes_nothing(damage):
    q, k, v, cache, slots, table, lens = _paged(2, 4, 2, 16, 4, [9, 6], torch.float32, seed=5)
    slots, table, lens = slots.clone(), table.clone(), lens.clone()
    if damage == "slot past the cache":
        slots[1] = cache.shape[2] * cache.shape[3]
    elif damage == "negative slot":
        slots[0] = -1
    elif damage == "block id past the cache":
        table[0, 1] = cache.shape[2]
    elif damage == "empty context":
        lens[1] = 0
    else:
        lens[0] = table.shape[1] * 4 + 1
    before = cache.clone()
    with pytest.raises(IndexError, match="outside the KV cache"):
        fa.paged_decode(q, k, v, cache, 0, slots, table, lens, 0.25)
    assert torch.equal(cache, before)
    # and the next call with good indexes works
    _, _, _, _, good_slots, good_table, good_lens = _paged(2, 4, 2, 16, 4, [9, 6],
                                                           torch.float32, seed=5)
    want_cache, want = _paged_reference(q, k, v, cache, good_slots, good_table, good_lens, 0, 0.25)
    out = fa.paged_decode(q, k, v, cache, 0, good_slots, good_table, good_lens, 0.25)
    assert torch.equal(cache, want_cache)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=0)


def test_paged_decode_refuses_mixed_dtypes():
    q, k, v, cache, slots, table, lens = _paged(1, 4, 2, 16, 4, [9], torch.float32, seed=6)
    with pytest.raises(TypeError, match="one dtype"):
        fa.paged_decode(q.bfloat16(), k, v, cache, 0, slots, table, lens, 0.25)
    with pytest.raises(TypeError, match="contiguous CPU cache"):
        fa.paged_decode(q, k, v, cache.transpose(2, 3), 0, slots, table, lens, 0.25)


@pytest.mark.parametrize("kv_head_of_q,takes", [([0, 0, 0, 1, 1, 1], True), ([0, 1, 2], True),
                                                ([0, 0, 0], True), ([0, 1, 0, 1], False),
                                                ([0, 0, 1], False), ([], False)])
def test_it_takes_whole_groups_of_consecutive_query_heads(kv_head_of_q, takes):
    assert fa.takes_paged_decode(torch.float32, 64, kv_head_of_q) == takes
    assert not fa.takes_paged_decode(torch.float16, 64, [0, 1])
    assert not fa.takes_paged_decode(torch.float32, 24, [0, 1])


def test_a_decode_graph_where_it_wins_runs_it_and_keeps_the_tokens(tiny_model_dir, monkeypatch,
                                                                    tmp_path):
    """compile=True with the fused kernel made to win the decode graph's timing: every layer of
    every decode step stores and attends through it, the greedy tokens are those of the graph's
    own tensor math, and the decode graphs an engine that did not pick it kept on disk do not
    run in its place."""
    import json

    from engine import LLM, SamplingParams

    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(fresh_cache(tmp_path)))
    monkeypatch.setattr(kc, "_time_decode_in_graph", lambda heads, block, context, dtype: (
        {"tensor-math": 3e-3, "fused": 1e-3}))
    # and the steps' own timing made to keep the graphs (on a busy machine eager decode steps
    # may time faster, and would never reach the decode graph)
    monkeypatch.setattr(kc, "_time_step", lambda kind, candidates, rounds: [
        run() for run in candidates.values()] and {"graph": 1.0, "eager": 2.0})
    path = tiny_model_dir("llama")
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    prompts = [[(7 * i) % 200 + 3 for i in range(40)], [(5 * i) % 150 + 9 for i in range(23)]]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    tokens = {}
    for choice in ("fixed", "measure"):  # the built-in's graphs are kept first
        with LLM(str(path), kernel_choice=choice, compile=True, block_size=16,
                 enable_prefix_caching=False) as llm:
            outputs, called = op_calls(llm, lambda: llm.generate(prompts, params),
                                       {"prefill::fused_paged_decode"})
            tokens[choice] = [list(o.token_ids) for o in outputs]
            calls = [shapes[0][0] for _, shapes in called]  # each call's rows
            if choice == "fixed":
                assert calls == []
            else:
                [info] = llm.rank_info()
    assert any(line.startswith("graph-decode-attention") and ": fused (" in line
               for line in info.kernels)
    # two sequences decode together: 4 steps of 2 rows, each through every layer
    assert calls == [2] * (4 * layers)
    assert tokens["measure"] == tokens["fixed"]
