"""engine.rank.kernel_choice: the CPU kernels timed at start-up. Whatever is picked computes the
same products as a float64 reference; a clearly slower candidate loses and a close one leaves the
built-in kernel in place; timings are kept on disk and a damaged file is measured over."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from engine import LLM, SamplingParams, machine
from engine.errors import ConfigError
from engine.rank import gemm
from engine.rank import kernel_choice as kc, worker
from engine.rank.attention import torch_attention
from engine.rank.kv_cache import KVCache
from engine.rank.step_metadata import build_step_metadata
from tests.cpu_features import needs_onednn, needs_onednn_bf16

HEADS = (4, 2, 16)  # query heads, KV heads, head dim


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(tmp_path))
    return tmp_path / "kernel_timings.json"


def _measured(dtype=torch.float32, max_tokens=64,
              max_context=0) -> tuple[kc.KernelChoice, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(out, 32, generator=gen) / 6).to(dtype) for out in (48, 64)]
    choice = kc.KernelChoice(dtype)
    choice.measure(weights, HEADS, max_tokens, max_context=max_context)
    return choice, weights


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64, 100])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_every_pick_computes_the_product(cache, rows, dtype, tol):
    choice, weights = _measured(dtype)
    x = torch.randn(rows, 32).to(dtype)
    bias = torch.randn(48).to(dtype)
    for w, b in ((weights[0], bias), (weights[1], None)):
        ref = x.double() @ w.double().t() + (0 if b is None else b.double())
        torch.testing.assert_close(choice.linear(x, w, b).double(), ref, rtol=0, atol=tol * 4)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_every_linear_candidate_computes_the_product(dtype, tol):
    """Every candidate, picked or not, with and without a bias; the matrix-vector product is a
    candidate for one row only, and given more rows it still computes their product."""
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(48, 32, generator=gen) / 6).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype)
    assert "mv" in kc.linear_kernels(dtype, 1)
    assert all("mv" not in kc.linear_kernels(dtype, rows) for rows in (2, 4, 64))
    for rows, kernels in ((1, kc.linear_kernels(dtype, 1)), (3, kc.linear_kernels(dtype, 3)),
                          (3, {"mv": kc.matrix_vector_linear})):
        x = torch.randn(rows, 32, generator=gen).to(dtype)
        for name, kernel in kernels.items():
            for b in (bias, None):
                ref = x.double() @ w.double().t() + (0 if b is None else b.double())
                got = kernel(x, w, b)
                assert got.shape == (rows, 48) and got.dtype == dtype, name
                torch.testing.assert_close(got.double(), ref, rtol=0, atol=tol * 4)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_every_attention_candidate_is_causal_attention(dtype, tol):
    """Each candidate, whole prompt or a chunk after a cached prefix, against the softmax formula."""
    gen = torch.Generator().manual_seed(1)
    num_q, num_kv, d = HEADS
    q, k, v = (torch.randn(n, h, d, generator=gen).to(dtype)
               for n, h in ((7, num_q), (20, num_kv), (20, num_kv)))
    kf, vf = (t.double().repeat_interleave(num_q // num_kv, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), kf) * d ** -0.5
    seen = torch.arange(20)[None, :] <= torch.arange(13, 20)[:, None]
    ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), vf)
    kernels = kc.attention_kernels(dtype)
    assert list(kernels) == ["sdpa", "blocked", "fused"]
    for name, kernel in kernels.items():
        if name == "sdpa":  # the masked chunk is attention.sdpa_attention's, checked elsewhere
            whole = kernel(q[:7].double(), k[:7].double(), v[:7].double(), d ** -0.5)
            continue
        torch.testing.assert_close(kernel(q, k, v, d ** -0.5).double(), ref, rtol=0, atol=tol)
    torch.testing.assert_close(whole, kernels["blocked"](
        q[:7].double(), k[:7].double(), v[:7].double(), d ** -0.5), rtol=0, atol=1e-9)


@pytest.mark.parametrize("kv_heads", [2, 4])  # grouped query heads; one K/V head per query head
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_every_decode_attention_candidate_is_one_querys_attention(kv_heads, dtype, tol):
    gen = torch.Generator().manual_seed(5)
    num_q, _, d = HEADS
    q = torch.randn(1, num_q, d, generator=gen).to(dtype)
    k, v = (torch.randn(37, kv_heads, d, generator=gen).to(dtype) for _ in range(2))
    kf, vf = (t.double().repeat_interleave(num_q // kv_heads, dim=1) for t in (k, v))
    weights = (torch.einsum("qhd,khd->hqk", q.double(), kf) * d ** -0.5).softmax(-1)
    ref = torch.einsum("hqk,khd->qhd", weights, vf)
    kernels = kc.decode_attention_kernels(dtype)
    assert list(kernels) == ["sdpa", "float32"]
    for name, kernel in kernels.items():
        out = kernel(q, k, v, d ** -0.5)
        assert out.dtype == dtype and out.shape == q.shape, name
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=tol)


def _decode_float32_wins(monkeypatch):
    """The timing says the float32 decode attention is twice as fast as SDPA."""
    timed = kc._time_attention

    def float32_wins(heads, tokens, dtype, kernels, queries=None):
        if queries == 1:
            return {"sdpa": 2e-3, "float32": 1e-3}
        return timed(heads, tokens, dtype, kernels, queries)

    monkeypatch.setattr(kc, "_time_attention", float32_wins)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_is_timed_per_context_bucket(cache, monkeypatch, dtype):
    """One pick per context bucket up to the longest context; steps past it take the top
    bucket's pick; nothing is timed without a context."""
    untimed, _ = _measured(dtype, max_context=0)
    assert not [p for p in untimed.picks if p.op == "decode-attention"]
    assert untimed.decode_kernel(50, dtype) is None
    timed, _ = _measured(dtype, max_context=100)
    picks = [p for p in timed.picks if p.op == "decode-attention"]
    assert [p.rows for p in picks] == [1, 4, 16, 64, 100]
    assert all(set(p.seconds) == {"sdpa", "float32"} and p.built_in == "sdpa" for p in picks)
    assert all(p.describe().startswith(f"decode-attention 4x2x16 at {p.rows} keys: ")
               for p in picks)
    _decode_float32_wins(monkeypatch)
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(cache.parent / "another"))
    choice, _ = _measured(dtype, max_context=100)
    for kv_len in (1, 50, 100, 5000):
        assert choice.decode_kernel(kv_len, dtype) is kc.float32_decode_attention


def test_the_step_attention_follows_the_pick(cache):
    """torch_attention with a choice's prompt kernel gives what it gives with the built-in rule,
    whichever kernel was picked, for a prompt and a chunk after a cached prefix."""
    choice, _ = _measured()
    num_q, num_kv, d = HEADS
    kv = KVCache(1, 4, 16, num_kv, d, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    for context, new in ((20, 20), (30, 10)):
        q = torch.randn(new, num_q, d, generator=gen)
        k, v = (torch.randn(new, num_kv, d, generator=gen) for _ in range(2))
        meta = build_step_metadata([0, new], [context], [[0, 1]], list(range(context - new, context)),
                                   [h * num_kv // num_q for h in range(num_q)], "cpu")
        kv.store(0, k, v, meta.slot_mapping)
        fixed = torch_attention(0, q, k, v, kv, meta, d ** -0.5)
        chosen = torch_attention(0, q, k, v, kv, meta, d ** -0.5, prompt_kernel=choice.prompt_kernel)
        torch.testing.assert_close(chosen, fixed, rtol=0, atol=1e-5)


def test_a_clearly_slower_kernel_loses_and_a_close_one_keeps_the_built_in():
    times = kc.fastest({"slow": lambda: time.sleep(0.003), "fast": lambda: None}, min_rounds=2,
                       min_seconds=0)
    assert times["slow"] >= 0.003 > times["fast"]
    assert kc.Pick("linear", (8, 8), 1, built_in="slow", seconds=times).kernel == "fast"
    close = {"onednn": 1.05e-3, "torch": 1.0e-3}  # within MARGIN of each other
    assert kc.Pick("linear", (8, 8), 1, built_in="onednn", seconds=close).kernel == "onednn"
    assert kc.Pick("linear", (8, 8), 1, built_in="torch", seconds=close).kernel == "torch"


@pytest.mark.parametrize("rows,bucket", [(1, 0), (2, 1), (4, 1), (5, 2), (16, 2), (17, 3),
                                         (1024, 5), (1025, 6), (4096, 6), (4097, 7)])
def test_row_buckets(rows, bucket):
    assert kc.row_bucket(rows) == bucket


def test_timings_are_kept_and_a_damaged_file_is_measured_over(cache):
    first, _ = _measured()
    assert first.picks and not any(p.from_disk for p in first.picks)
    second, _ = _measured()
    assert all(p.from_disk for p in second.picks)
    assert [p.kernel for p in second.picks] == [p.kernel for p in first.picks]
    entries = json.loads(cache.read_text())
    assert len(entries) == len(first.picks)
    # a candidate missing, a negative time, no time of timing, times of the old format (no
    # "seconds"): each measured again, not trusted
    keys = sorted(entries)
    entries[keys[0]]["seconds"] = {"onednn": 1.0}
    entries[keys[1]]["seconds"] = {name: -1.0 for name in entries[keys[1]]["seconds"]}
    entries[keys[2]]["timed"] = "yesterday"
    entries[keys[3]] = entries[keys[3]]["seconds"]
    cache.write_text(json.dumps(entries))
    third, _ = _measured()
    assert sum(not p.from_disk for p in third.picks) == 4
    cache.write_text("{ not json")
    fourth, _ = _measured()
    assert not any(p.from_disk for p in fourth.picks)
    assert len(json.loads(cache.read_text())) == len(first.picks)


def test_an_old_timing_is_measured_again_each_candidate_keeping_its_better_time(
        cache, monkeypatch):
    """A kept timing older than REMEASURE_AFTER (or stamped later than now: a clock set back)
    is measured again, and each candidate keeps the lower of its kept and new times: a first
    timing in which the faster kernel was slowed by something else running decides only until
    then."""
    clock = [1000.0]
    # the modules' clock only: the process's time.time runs on
    stopped = SimpleNamespace(time=lambda: clock[0], perf_counter=time.perf_counter)
    monkeypatch.setattr(kc, "time", stopped)
    monkeypatch.setattr(machine, "time", stopped)
    times = iter([{"slow": 4.0, "fast": 9.0},  # "fast" slowed at the first timing
                  {"slow": 5.0, "fast": 1.0}, {"slow": 3.0, "fast": 2.0}])
    timed = []

    def choose() -> kc.Pick:
        pick = kc.Pick("linear", (8, 8), 4, "slow", margin=1.0)
        store = kc.TimingStore.open()
        store.get_or_time(pick, torch.float32, {"slow": None, "fast": None},
                          lambda: timed.append(clock[0]) or next(times))
        store.save()
        return pick

    assert choose().kernel == "slow" and timed == [1000.0]
    clock[0] += machine.REMEASURE_AFTER  # still within: read, not timed
    kept = choose()
    assert kept.from_disk and kept.seconds == {"slow": 4.0, "fast": 9.0} and len(timed) == 1
    clock[0] += 1
    again = choose()
    assert not again.from_disk and again.seconds == {"slow": 4.0, "fast": 1.0}
    assert again.kernel == "fast" and timed[-1] == clock[0]
    assert choose().from_disk and len(timed) == 2  # the new timing's time is kept with it
    clock[0] -= 10  # the clock set back behind the timing: measured again
    assert choose().seconds == {"slow": 3.0, "fast": 1.0} and len(timed) == 3


def test_timings_taken_under_one_openmp_are_not_trusted_under_the_other(cache, monkeypatch):
    """The process's OpenMP (engine.cpu_runtime: torch's libgomp, or Intel's preloaded) is
    part of a kept timing's key: the other runtime measures anew, and each finds its own."""
    from engine import cpu_runtime

    ran_here = cpu_runtime.openmp()
    other = {"gnu": "intel", "intel": "gnu"}[ran_here]
    first, _ = _measured()
    monkeypatch.setattr(cpu_runtime, "openmp", lambda: other)
    under_other, _ = _measured()
    assert not any(p.from_disk for p in under_other.picks)
    again, _ = _measured()
    assert all(p.from_disk for p in again.picks)
    monkeypatch.setattr(cpu_runtime, "openmp", lambda: ran_here)
    back, _ = _measured()
    assert all(p.from_disk for p in back.picks)
    assert [p.seconds for p in back.picks] == [p.seconds for p in first.picks]


def test_a_changed_fused_kernel_times_the_attention_again(cache, monkeypatch):
    """Prompt attention timings are kept per fused-kernel source: after a change to it (a new
    version of the engine) the attention buckets are timed again, and nothing else is."""
    from engine.rank import fused_attention

    _measured()
    monkeypatch.setattr(fused_attention, "source_hash", lambda: "another kernel")
    again, _ = _measured()
    assert {p.op for p in again.picks if not p.from_disk} == {"attention"}
    assert all(p.from_disk for p in again.picks if p.op != "attention")


def test_an_unwritable_cache_still_measures(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(blocker / "below_a_file"))
    choice, weights = _measured()
    assert choice.picks
    x = torch.randn(5, 32)
    torch.testing.assert_close(choice.linear(x, weights[0]), x @ weights[0].t())


def test_engine_reports_its_picks_and_tokens_do_not_change(tiny_model_dir, cache):
    path = str(tiny_model_dir("llama"))
    prompts = [[5, 9, 2, 7, 11, 3, 8, 1] * 3, [4, 4, 6]]
    outs = {}
    for choice in ("measure", "fixed"):
        with LLM(path, kernel_choice=choice, max_num_batched_tokens=64) as llm:
            [info] = llm.rank_info()
            outs[choice] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6))]
            if choice == "measure":
                assert any(line.startswith("linear") for line in info.kernels)
                assert any(line.startswith("attention") for line in info.kernels)
            else:
                assert info.kernels == [] and info.kernel_choice_s == 0.0
    assert outs["measure"] == outs["fixed"]


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 3])
def test_a_packed_bf16_weight_computes_the_product(rows):
    gen = torch.Generator().manual_seed(2)
    w, x = (torch.randn(*shape, generator=gen).bfloat16() for shape in ((48, 32), (rows, 32)))
    bias = torch.randn(48, generator=gen).bfloat16()
    y = gemm.linear(x, gemm.pack_for_rows(w, 1), bias)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), x.double() @ w.double().t() + bias.double(),
                               rtol=0, atol=0.12)


@needs_onednn_bf16
def test_only_a_bf16_model_times_packed_decode_copies(cache):
    for dtype, timed in ((torch.float32, False), (torch.bfloat16, True)):
        choice, weights = _measured(dtype)
        decode_picks = [p for p in choice.picks if p.op == "decode-weights"]
        assert bool(decode_picks) == timed
        assert sorted(p.shape for p in decode_picks) == ([(48, 32), (64, 32)] if timed else [])
        assert all(set(p.seconds) == {"plain", "packed"} for p in decode_picks)



def _gated_timed(monkeypatch, winner: str) -> list[tuple[int, int]]:
    """The gate/up product with its SiLU·mul timed faster by `winner` ("whole", "halves");
    the (rows, out features) timed."""
    timed = []

    def timing(weight, rows):
        timed.append((rows, weight.shape[0]))
        return {"whole": 2e-3, "halves": 2e-3, winner: 1e-3}

    monkeypatch.setattr(kc, "_time_gated", timing)
    return timed


def _both_choices(path: str, compile: bool, recorded: list) -> tuple[dict, dict, dict, dict]:
    """With kernel_choice "measure", then "fixed": the rank's info, the logits of a prefill of
    two prompts (one step of 45 rows), the tokens generate gives them (prefix cached: a
    13-row prompt step, then 2-row decode steps), and what `recorded` gathered meanwhile."""
    prompts = [[5, 9, 2, 7, 11, 3, 8, 1] * 3, [4, 4, 6] * 7]
    outs, infos, logits, seen = {}, {}, {}, {}
    for choice in ("measure", "fixed"):
        with LLM(path, kernel_choice=choice, max_num_batched_tokens=64, compile=compile) as llm:
            [infos[choice]] = llm.rank_info()
            recorded.clear()
            logits[choice] = [o.logits for o in llm.prefill(prompts)]
            generated = llm.generate(prompts, SamplingParams(max_tokens=6))
            outs[choice] = [o.token_ids for o in generated]
            seen[choice] = list(recorded)
    return outs, infos, logits, seen


def _prompt_copies_timed(monkeypatch, speedup: float | dict) -> list[int]:
    """Each shape's prompt copy timed `speedup` times faster than its plain weight (a dict:
    per shape); the rows each timing ran."""
    rows = []

    def timed(plain, weight, n):
        rows.append(n)
        times = speedup.get(tuple(weight.shape), 1.0) if isinstance(speedup, dict) else speedup
        return {"plain": 1e-3 * times, "packed": 1e-3}

    monkeypatch.setattr(kc, "_time_prompt_copy", timed)
    return rows


@needs_onednn
def test_prompt_copies_are_picked_shape_by_shape_with_a_margin_of_their_own(cache, monkeypatch):
    """A pick per projection shape but the LM head's, timed at a prompt's rows (the token
    budget where smaller); a shape's packed copy wins beyond PROMPT_COPY_MARGIN (below the other
    picks' MARGIN), and then that shape's prompt-sized buckets run oneDNN, which reads it; the
    other shapes keep their plain weights and kernels."""
    rows = _prompt_copies_timed(monkeypatch, {(48, 32): 1.05, (64, 32): 1.01})
    weights = [torch.randn(out, 32) for out in (48, 64, 80)]
    choice = kc.KernelChoice(torch.float32)
    choice.measure(weights, HEADS, 64, lm_head_shape=(80, 32))
    picks = {p.shape: p for p in choice.picks if p.op == "prompt-weights"}
    assert rows == [64, 64] and set(picks) == {(48, 32), (64, 32)}
    assert all(p.rows == 64 for p in picks.values())
    assert kc.PROMPT_COPY_MARGIN < 1.05 < kc.MARGIN
    assert picks[(48, 32)].kernel == "packed" and picks[(64, 32)].kernel == "plain"
    assert choice.packed_prompt_shapes == {(48, 32)}
    prompt_bucket, decode_bucket = kc.row_bucket(64), kc.row_bucket(gemm.PLAIN_WEIGHT_ROWS)
    assert choice._linear[(48, 32, prompt_bucket)] is gemm.eager_onednn_linear
    plain_prompt = [p for p in choice.picks if p.op == "linear" and p.shape == (64, 32)
                    and p.rows == 64]
    assert (choice._linear[(64, 32, prompt_bucket)] is not gemm.eager_onednn_linear
            or plain_prompt[0].kernel == "onednn")
    for shape in ((48, 32), (64, 32)):  # decode-sized products keep their own picks
        assert choice._linear[(*shape, decode_bucket)] is not gemm.eager_onednn_linear or (
            [p for p in choice.picks if p.op == "linear" and p.shape == shape
             and p.rows == gemm.PLAIN_WEIGHT_ROWS][0].kernel == "onednn")
    # a token budget of at most PLAIN_WEIGHT_ROWS: no prompt is long enough to gain
    small = kc.KernelChoice(torch.float32)
    small.measure(weights, HEADS, gemm.PLAIN_WEIGHT_ROWS)
    assert not [p for p in small.picks if p.op == "prompt-weights"] and rows == [64, 64]


@needs_onednn
def test_a_kept_copy_timing_against_another_plain_kernel_is_measured_again(cache, monkeypatch):
    """A packed copy's timing is against the plain weight's pick: where that pick changed (its
    kept timings measured again, now MKL's product faster than oneDNN's), the copy's kept
    timing is not trusted, and the copy is timed against the new pick."""
    rows = _prompt_copies_timed(monkeypatch, 1.0)
    monkeypatch.setattr(kc, "_time_linear", lambda kernels, weight, n, prepare=None: {
        name: 1e-3 if name == "onednn" else 2e-3 for name in kernels})
    weights = [torch.randn(48, 32)]
    for plain, from_disk, timings in (("onednn", False, 1), ("onednn", True, 1),
                                      ("torch", False, 2)):
        if plain == "torch":  # the projection's kept timings, as a new measurement leaves them
            entries = json.loads(cache.read_text())
            for key in (k for k in entries if "|linear|" in k):
                entries[key]["seconds"]["torch"] = entries[key]["seconds"]["onednn"] / 4
            cache.write_text(json.dumps(entries))
        choice = kc.KernelChoice(torch.float32)
        choice.measure(weights, HEADS, 64)
        [copy] = [p for p in choice.picks if p.op == "prompt-weights"]
        assert [p.kernel for p in choice.picks if p.op == "linear" and p.rows == 64] == [plain]
        assert copy.from_disk == from_disk and len(rows) == timings


@needs_onednn
def test_prompt_copies_that_would_crowd_memory_are_not_offered(cache, monkeypatch):
    """Copies of more than PROMPT_COPY_MEMORY of the memory available are not timed, nor made
    however much faster they would be; within it they are."""
    rows = _prompt_copies_timed(monkeypatch, 2.0)
    weights = [torch.randn(out, 32) for out in (48, 64)]  # 14 KiB to copy
    for available, offered in ((2 * 14 * 1024 - 1, False), (2 * 14 * 1024, True)):
        monkeypatch.setattr(kc, "available_bytes", lambda: available)
        choice = kc.KernelChoice(torch.float32)
        choice.measure(weights, HEADS, 64)
        assert bool([p for p in choice.picks if p.op == "prompt-weights"]) == offered
        assert bool(choice.packed_prompt_shapes) == offered
    assert rows == [64, 64]


@needs_onednn
def test_a_prompt_copy_serves_its_weight_until_the_weight_is_written(monkeypatch):
    """Products of more than PLAIN_WEIGHT_ROWS rows read the registered copy (and compute the
    product); a view at the weight's address, a few-row product or a weight written in place
    since read the weight itself: a stale copy would be a wrong answer."""
    copies = gemm.PromptCopies()
    monkeypatch.setattr(gemm, "PROMPT_COPIES", copies)
    found = []
    find = copies.find
    monkeypatch.setattr(copies, "find", lambda w: found.append(find(w) is not w) or find(w))
    gen = torch.Generator().manual_seed(3)
    w, bias = torch.randn(48, 32, generator=gen), torch.randn(48, generator=gen)
    assert copies.add([w, torch.randn(8, 8).requires_grad_(False)], 64) == w.nbytes + 256
    with torch.inference_mode():  # no version counter: never copied
        assert copies.add([torch.randn(8, 8)], 64) == 0
    x = torch.randn(gemm.PLAIN_WEIGHT_ROWS + 1, 32, generator=gen)
    for weight in (w, w * 1):
        torch.testing.assert_close(gemm.eager_onednn_linear(x, weight, bias), x @ weight.t() + bias)
    assert found == [True, False]
    view = w[:16]  # the weight's address, another shape
    assert find(view) is view
    gemm.eager_onednn_linear(x[:gemm.PLAIN_WEIGHT_ROWS], w)
    assert found == [True, False]  # a decode-sized product does not look
    w.mul_(-1)
    torch.testing.assert_close(gemm.eager_onednn_linear(x, w), x @ w.t())
    assert found[-1] is False
    copies.remove([w.data_ptr()])
    assert find(w) is w


@needs_onednn
@pytest.mark.parametrize("compile", [False, True])
def test_prompts_read_packed_copies_where_they_won(tiny_model_dir, cache, monkeypatch, compile):
    """Packed prompt copies made to win the timing: every projection but the LM head is held
    once more (the picks and the bytes say so), prompt steps read the copies, eagerly and
    through the layers graph, decode steps do not, and logits and tokens are those of the
    plain weights."""
    copies = gemm.PromptCopies()
    monkeypatch.setattr(gemm, "PROMPT_COPIES", copies)
    read = []
    find = copies.find
    monkeypatch.setattr(copies, "find",
                        lambda w: find(w) if find(w) is w else read.append(len(w)) or find(w))
    _prompt_copies_timed(monkeypatch, 2.0)
    _gated_timed(monkeypatch, "whole")  # gate/up keeps its whole copy here
    outs, infos, logits, reads = _both_choices(str(tiny_model_dir("llama")), compile, read)
    cfg = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    h, ffn, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    # the prefill's one step (both prompts: 45 rows) reads q/k/v, o, gate/up and down's copies
    # in every layer but the last, whose o_proj and MLP run the 2 sampled rows; generate's
    # prompt step (the rows after the cached blocks: 13) and the decode steps' (2 rows) read none
    want = [h + 2 * kv, h, 2 * ffn, h] * (layers - 1) + [h + 2 * kv]
    assert reads == {"measure": want, "fixed": []}
    per_layer = h * (h + 2 * kv) + h * h + 2 * ffn * h + ffn * h
    assert infos["measure"].weight_bytes - infos["fixed"].weight_bytes == 4 * layers * per_layer
    assert [line for line in infos["measure"].kernels if line.startswith("prompt-weights")]
    for got, want in zip(logits["measure"], logits["fixed"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert outs["measure"] == outs["fixed"]

def test_the_walkthrough_counts_each_ops_wins(cache):
    from report.tables import _kernel_lines

    choice, _ = _measured(torch.bfloat16, max_context=64)
    lines = _kernel_lines(choice.describe())
    # packed decode and prompt copies are timed where oneDNN multiplies bf16
    # (test_without_onednn_bf16_*)
    ops = (["linear", "attention", "decode-attention"]
           + ["decode-weights", "prompt-weights"] * gemm.HAVE_ONEDNN_BF16)
    assert [line.split(" ", 1)[0] for line in lines] == ops
    for line, op in zip(lines, ops):
        picks = [p for p in choice.picks if p.op == op]
        counts = {k: sum(p.kernel == k for p in picks) for k in {p.kernel for p in picks}}
        assert line.endswith(", ".join(f"{k} fastest in {n} of {len(picks)} shape/row cases"
                                       for k, n in sorted(counts.items())))
    float32_lines = _kernel_lines(_measured(torch.float32, max_context=64)[0].describe())
    assert [line.split(" ", 1)[0] for line in float32_lines] == [
        "linear", "attention", "decode-attention", *["prompt-weights"] * gemm.HAVE_ONEDNN]


def test_the_walkthrough_gives_every_timed_op_a_line():
    """Ops timed only by some settings (int8-rows: quantized weights; graph-decode-attention:
    compile=True) and ops the walkthrough does not know by name each get their line."""
    from report.tables import _kernel_lines

    def pick(op: str, shape: tuple, winner: str, loser: str) -> kc.Pick:
        return kc.Pick(op, shape, 4, loser, {winner: 1e-3, loser: 1e-2})

    picks = [pick("graph-decode-attention", (9, 3, 64), "fused", "tensor-math"),
             pick("int8-rows", (49152, 576), "cpp", "torch"),
             pick("int8-rows", (1536, 576), "torch", "cpp"),
             pick("int8-rows", (576, 1536), "cpp", "torch"),
             pick("a-future-op", (), "new", "old"),
             pick("linear", (576, 576), "onednn", "mkl")]
    lines = _kernel_lines([p.describe() for p in picks])
    assert lines == [
        "linear kernels timed here at start-up (rank 0): onednn fastest in 1 of 1 shape/row cases",
        "int8-rows kernels timed here at start-up (rank 0): cpp fastest in 2 of 3 shape/row "
        "cases, torch fastest in 1 of 3 shape/row cases",
        "graph-decode-attention kernels timed here at start-up (rank 0): fused fastest in 1 of 1 "
        "shape/row cases",
        "a-future-op kernels timed here at start-up (rank 0): new fastest in 1 of 1 shape/row cases"]


def _eager_decode_steps(monkeypatch) -> None:
    """Decode steps stay eager: their layers are not offered the C++ call, which runs none of
    the kernels these tests count."""
    monkeypatch.setattr(worker, "float_unfit_reason",
                        lambda model, heads: "kept eager: the test counts an eager step's kernels")


def _calls_of_the_pick(monkeypatch, tiny_model_dir, kernel: str, prompts: list[list[int]],
                       **settings) -> tuple[dict, dict, list[str], int]:
    """`prompts` (6 greedy tokens each) with the timed choice and with the fixed one, counting
    the rows of every call of kc.<kernel>: (rows of each call, tokens: both per choice; the
    timed choice's kernel lines; the model's layer count). Eager steps (compile=False): a
    bf16 engine that times its kernels compiles by default, and graphs run no picked kernel."""
    _eager_decode_steps(monkeypatch)
    picked, rows = getattr(kc, kernel), []
    monkeypatch.setattr(kc, kernel, lambda x, *rest: rows.append(len(x)) or picked(x, *rest))
    path = tiny_model_dir("llama")
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    calls, outs = {}, {}
    for choice in ("measure", "fixed"):
        with LLM(str(path), kernel_choice=choice, max_num_batched_tokens=64, compile=False,
                 **settings) as llm:
            rows.clear()
            outs[choice] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6))]
            calls[choice] = list(rows)
            if choice == "measure":
                [info] = llm.rank_info()
    return calls, outs, info.kernels, layers


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_steps_run_the_picked_attention(tiny_model_dir, cache, monkeypatch, dtype):
    """The float32 decode attention made to win: every decode step's every layer runs it, and
    the tokens are those of SDPA's (the built-in choice)."""
    _decode_float32_wins(monkeypatch)
    calls, outs, kernels, layers = _calls_of_the_pick(
        monkeypatch, tiny_model_dir, "float32_decode_attention",
        [[5, 9, 2, 7, 11, 3, 8, 1] * 3, [4, 4, 6]], dtype=dtype)
    assert any(line.startswith("decode-attention") and ": float32 (" in line for line in kernels)
    # 5 decode steps of 2 sequences, one query each, in every layer
    assert calls == {"measure": [1] * (5 * 2 * layers), "fixed": []}
    assert outs["measure"] == outs["fixed"]


def test_one_row_steps_run_the_picked_matrix_vector_product(tiny_model_dir, cache, monkeypatch):
    """The matrix-vector product made to win every one-row bucket: each decode step of one
    sequence runs it for every projection and the LM head, and the tokens are those of the
    built-in kernels."""
    timed = kc._time_linear

    def mv_wins(kernels, weight, rows, prepare=None):
        if "mv" in kernels:
            return {name: 1e-3 if name == "mv" else 2e-3 for name in kernels}
        return timed(kernels, weight, rows, prepare)

    monkeypatch.setattr(kc, "_time_linear", mv_wins)
    calls, outs, kernels, layers = _calls_of_the_pick(
        monkeypatch, tiny_model_dir, "matrix_vector_linear", [[5, 9, 2, 7, 11, 3, 8, 1] * 3])
    assert any(line.startswith("linear") and " at 1 rows: mv (" in line for line in kernels)
    # the prompt step's one sampled row through its last layer's o, gate/up and down and the
    # LM head, then 5 decode steps of q/k/v, o, gate/up and down in every layer plus the LM head
    assert calls == {"measure": [1] * (4 + 5 * (4 * layers + 1)), "fixed": []}
    assert outs["measure"] == outs["fixed"]


@needs_onednn_bf16
def test_bf16_decode_reads_packed_copies_where_they_won(tiny_model_dir, cache, monkeypatch):
    """Packed copies made to win the timing: decode steps read them (more bytes held, the
    picks say so) and the tokens are those of the plain weights."""
    timed = kc._time_linear

    def packed_wins(kernels, weight, rows, prepare=None):
        return {"plain": 2e-3, "packed": 1e-3} if prepare else timed(kernels, weight, rows)

    monkeypatch.setattr(kc, "_time_linear", packed_wins)
    _eager_decode_steps(monkeypatch)
    path = str(tiny_model_dir("llama"))
    prompts = [[5, 9, 2, 7, 11, 3, 8, 1] * 3, [4, 4, 6]]
    packed_products = []
    onednn_only = gemm._onednn_only  # where products with a packed weight go
    monkeypatch.setattr(gemm, "_onednn_only",
                        lambda x, w, b: packed_products.append(len(x)) or onednn_only(x, w, b))
    monkeypatch.setattr(kc, "_time_prompt_copy",  # prompts keep the plain weights here
                        lambda plain, weight, rows: {"plain": 1e-3, "packed": 2e-3})
    outs, infos, prompt_logits, reads = {}, {}, {}, {}
    for choice in ("measure", "fixed"):  # eager steps: decode graphs read no packed copies
        with LLM(path, dtype="bfloat16", kernel_choice=choice, max_num_batched_tokens=64,
                 compile=False) as llm:
            [infos[choice]] = llm.rank_info()
            packed_products.clear()
            prompt_logits[choice] = [o.logits for o in llm.prefill(prompts)]
            reads[choice] = list(packed_products)
            outs[choice] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8))]
    # a prompt step reads the packed LM head for its two sampled rows, and nothing else packed
    assert reads == {"measure": [2], "fixed": []}
    for got, want in zip(prompt_logits["measure"], prompt_logits["fixed"]):
        # the same bf16 product in another blocking: its float32 sums round to bf16 a few ulps apart
        torch.testing.assert_close(got, want, rtol=0, atol=0.02 * want.abs().max().item())
    packed = [line for line in infos["measure"].kernels if line.startswith("decode-weights")]
    assert packed and all(": packed (" in line for line in packed)
    # every projection weight once more, in bf16: q/k/v, o, gate/up, down per layer + LM head
    cfg = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    h, ffn, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 2 * ffn * h + ffn * h
    extra = 2 * (layers * per_layer + cfg["vocab_size"] * h)
    assert infos["measure"].weight_bytes - infos["fixed"].weight_bytes == extra
    assert outs["measure"] == outs["fixed"]


def test_without_onednn_bf16_a_bf16_model_times_torch_and_float32_products(cache, monkeypatch):
    """An AVX2-only CPU (oneDNN builds no bf16 products there; patched so on any CPU): a bf16
    model's projections choose between torch's bf16 GEMM, the built-in, and float32 products
    through torch's GEMM and through oneDNN's; no packed decode copies; prompt attention's
    built-in is SDPA. Every pick, and every candidate, is the product."""
    monkeypatch.setattr(gemm, "HAVE_ONEDNN_BF16", False)
    choice, weights = _measured(torch.bfloat16)
    linears = [p for p in choice.picks if p.op == "linear"]
    assert linears and all(
        set(p.seconds) == {"torch", "float32", "float32-onednn", *["mv"] * (p.rows == 1)}
        and p.built_in == "torch" for p in linears)
    assert not [p for p in choice.picks if p.op == "decode-weights"]
    assert all(p.built_in == "sdpa" for p in choice.picks if p.op == "attention")
    gen = torch.Generator().manual_seed(4)
    for rows in (1, 3, 64):
        x = torch.randn(rows, 32, generator=gen).bfloat16()
        for w in weights:
            bias = torch.randn(w.shape[0], generator=gen).bfloat16()
            want = x.double() @ w.double().t()
            torch.testing.assert_close(choice.linear(x, w).double(), want, rtol=0, atol=0.03)
            for name, kernel in kc.linear_kernels(torch.bfloat16, rows).items():
                got = kernel(x, w, bias)
                assert got.dtype == torch.bfloat16, name
                torch.testing.assert_close(got.double(), want + bias.double(), rtol=0, atol=0.03,
                                           msg=name)


def test_without_onednn_bf16_a_bf16_engine_matches_float32(tiny_model_dir, cache, monkeypatch):
    """A bf16 engine on such a CPU prefills within bf16 error of the float32 engine, with the
    timed kernels and with the built-in ones, and refuses decode_dtype='bfloat16' with its fix."""
    monkeypatch.setattr(gemm, "HAVE_ONEDNN_BF16", False)
    path = str(tiny_model_dir("llama"))
    prompt = [5, 9, 2, 7, 11, 3, 8, 1] * 8
    with LLM(path, max_num_batched_tokens=64) as llm:
        want = llm.prefill([prompt])[0].logits
    for choice in ("measure", "fixed"):
        with LLM(path, dtype="bfloat16", kernel_choice=choice, max_num_batched_tokens=64) as llm:
            got = llm.prefill([prompt])[0].logits
            [info] = llm.rank_info()
        assert not [line for line in info.kernels if line.startswith("decode-weights")]
        torch.testing.assert_close(got.float(), want, rtol=0, atol=0.05 * want.abs().max().item())
    with pytest.raises(ConfigError, match="unset decode_dtype"):
        LLM(path, decode_dtype="bfloat16")


def test_graph_rows_are_timed_in_compiled_graphs(cache):
    """compile=True, float32 and bf16: both ways of a graph's one-row products, compiled and
    timed, per dtype; the pick is kept on disk and read back; a float16 model is not timed."""
    weights = [torch.randn(48, 32), torch.randn(64, 32), torch.randn(40, 48)]
    choice = kc.KernelChoice(torch.float32)
    choice.choose_graph_rows(weights)
    [pick] = choice.picks
    assert pick.op == "graph-linear" and pick.shape == ((40, 48), (48, 32), (64, 32))
    assert set(pick.seconds) == {"multiply-and-sum", "torch"} and min(pick.seconds.values()) > 0
    assert choice.graph_rows_call_torch == (pick.kernel == "torch")
    again = kc.KernelChoice(torch.float32)
    again.choose_graph_rows(weights)
    assert again.picks[0].from_disk and again.picks[0].seconds == pick.seconds
    low = kc.KernelChoice(torch.bfloat16)
    low.choose_graph_rows([w.bfloat16() for w in weights])
    [bf16_pick] = low.picks
    assert not bf16_pick.from_disk and set(bf16_pick.seconds) == {"multiply-and-sum", "torch"}
    assert low.graph_rows_call_torch == (bf16_pick.kernel == "torch")
    half = kc.KernelChoice(torch.float16)
    half.choose_graph_rows([w.half() for w in weights])
    assert half.picks == [] and not half.graph_rows_call_torch


def test_graph_rows_timed_again_and_again_in_one_process():
    """A process that starts several engines times a graph's one-row products at each start:
    dynamo keeps 8 graphs per code object, and every candidate of every timing once compiled
    one code object, so the 9th compile failed (fullgraph) and the pick silently stayed the
    built-in (a warning said timing failed). Here 5 timings of 2 candidates, each of other
    shapes."""
    candidates = {"multiply-and-sum": gemm.matvec, "torch": torch.nn.functional.linear}
    for i in range(5):
        seconds = kc._time_in_graph(candidates, [torch.randn(16 * (i + 2), 32)])
        assert set(seconds) == set(candidates) and min(seconds.values()) > 0


def test_a_failed_compile_while_timing_keeps_the_built_in(cache, monkeypatch, caplog):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", no_compiler)
    choice = kc.KernelChoice(torch.float32)
    choice.choose_graph_rows([torch.randn(48, 32)])
    assert choice.picks == [] and not choice.graph_rows_call_torch
    assert "timing compiled products failed on this setup (RuntimeError: no C++ compiler)" in caplog.text


def test_the_decode_graphs_attention_is_timed_compiled_and_kept(cache):
    """compile=True: one decode row's store and attention, through the graph's tensor math and
    through the fused kernel, each compiled and timed (both write the cache and agree, or the
    timing would be of wrong code); the pick is kept on disk and read back; dtypes and head
    layouts the kernel does not take are not timed."""
    heads, mapping = (6, 2, 16), [0, 0, 0, 1, 1, 1]
    choice = kc.KernelChoice(torch.float32)
    choice.choose_graph_decode_attention(heads, mapping, block_size=8, max_context=100)
    [pick] = choice.picks
    assert (pick.op, pick.shape, pick.rows) == ("graph-decode-attention", heads, 100)
    assert set(pick.seconds) == {"tensor-math", "fused"} and min(pick.seconds.values()) > 0
    assert choice.graph_decode_fused == (pick.kernel == "fused")
    again = kc.KernelChoice(torch.float32)
    again.choose_graph_decode_attention(heads, mapping, block_size=8, max_context=5000)
    assert again.picks[0].rows == kc.GRAPH_DECODE_CONTEXT and not again.picks[0].from_disk
    again.choose_graph_decode_attention(heads, mapping, block_size=8, max_context=100)
    assert again.picks[1].from_disk and again.picks[1].seconds == pick.seconds
    for dtype, head_map in ((torch.float16, mapping), (torch.float32, [0, 1, 0, 1, 0, 1])):
        other = kc.KernelChoice(dtype)
        other.choose_graph_decode_attention(heads, head_map, block_size=8, max_context=100)
        assert other.picks == [] and not other.graph_decode_fused


def test_both_decode_graph_attentions_agree_as_timed():
    """What the timing runs: each candidate's compiled store and attention of one row gives
    the same answer, the float64 formula's, and writes the same new K/V."""
    from engine.rank.padded_decode import PaddedDecode, padded_context
    from tests.reference import causal_attention_float64

    gen = torch.Generator().manual_seed(4)
    outs, caches = {}, {}
    for fused in (False, True):
        cache = KVCache(1, 3, 4, 2, 16, torch.float32, torch.device("cpu"))
        cache.data.copy_(torch.randn(cache.data.shape, generator=torch.Generator().manual_seed(1)))
        ints = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
        # position 9, the 10th of blocks 2, 0, 1: block 1, slot 1, i.e. cache slot 1 * 4 + 1
        meta = PaddedDecode(ints([5]), ints([[2, 0, 1]]), ints([10]), torch.tensor([0, 0, 1, 1]))
        q, k, v = (torch.randn(1, h, 16, generator=torch.Generator().manual_seed(h + 7))
                   for h in (4, 2, 2))
        ctx = padded_context(ints([0]), ints([9]), meta, cache, False, fused=fused)

        def layer(ctx=ctx, q=q, k=k, v=v):
            ctx.ops.store(ctx, 0, k, v)
            return ctx.ops.attend(ctx, 0, q, k, v, 0.25)
        outs[fused] = torch.compile(layer, dynamic=False, fullgraph=True)()
        caches[fused] = cache.data.clone()
    assert torch.equal(caches[False], caches[True])
    keys = torch.cat([caches[True][0, 0, b] for b in (2, 0, 1)])[:10]
    values = torch.cat([caches[True][1, 0, b] for b in (2, 0, 1)])[:10]
    want = causal_attention_float64(q, keys, values, 0.25)
    for out in outs.values():
        torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=0)


def test_a_failed_compile_while_timing_the_decode_attention_keeps_its_tensor_math(
        cache, monkeypatch, caplog):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", no_compiler)
    choice = kc.KernelChoice(torch.float32)
    choice.choose_graph_decode_attention((4, 2, 16), [0, 0, 1, 1], 8, 100)
    assert choice.picks == [] and not choice.graph_decode_fused
    assert "timing the decode graph's attention failed on this setup" in caplog.text


@pytest.mark.parametrize("call_torch", [False, True])
def test_a_compiled_one_row_product_follows_the_pick(call_torch):
    gen = torch.Generator().manual_seed(3)
    w, x, b = (torch.randn(*shape, generator=gen) for shape in ((48, 32), (1, 32), (48,)))
    choice = kc.KernelChoice(torch.float32, graph_rows_call_torch=call_torch)
    products = []
    graph = torch.compile(choice.linear, dynamic=False, fullgraph=True,
                          backend=lambda gm, _: products.extend(
                              n.target for n in gm.graph.nodes if n.op == "call_function") or gm)
    torch.testing.assert_close(graph(x, w, b), x @ w.t() + b)
    assert (torch._C._nn.linear in products) == call_torch


def test_a_bad_setting_names_the_fix():
    with pytest.raises(ConfigError, match="kernel_choice='fastest'.*'measure'.*'fixed'"):
        LLM("smollm2", kernel_choice="fastest")


@needs_onednn
@pytest.mark.parametrize("compile", [False, True])
def test_prompts_fuse_the_silu_mul_where_packed_halves_won(tiny_model_dir, cache, monkeypatch,
                                                         compile):
    """The gate/up product made to win the timing with its SiLU·mul inside oneDNN: the rank
    packs its halves instead of the whole (the same bytes), prompt steps of more than
    PLAIN_WEIGHT_ROWS rows run them, eagerly and through the layers graph, decode-sized ones
    do not, and logits and tokens are those of the built-in choices."""
    copies = gemm.PromptCopies()
    monkeypatch.setattr(gemm, "PROMPT_COPIES", copies)
    fused_rows = []
    fused = gemm.gated_halves
    monkeypatch.setattr(gemm, "gated_halves",
                        lambda x, g, u: fused_rows.append(len(x)) or fused(x, g, u))
    _prompt_copies_timed(monkeypatch, 2.0)
    timed = _gated_timed(monkeypatch, "halves")
    outs, infos, logits, runs = _both_choices(str(tiny_model_dir("llama")), compile, fused_rows)
    cfg = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    h, ffn, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    assert timed == [(64, 2 * ffn)]  # one timing, at the copies' rows, of the gate/up shape
    # the prefill's step (45 rows) in every layer but the last, whose MLP runs the 2 sampled
    # rows; generate's prompt step (13 rows after the cached blocks) and decode steps: none
    assert runs == {"measure": [45] * (layers - 1), "fixed": []}
    assert [line for line in infos["measure"].kernels if line.startswith("gated-prompt")
            and ": halves (" in line]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 2 * ffn * h + ffn * h
    assert infos["measure"].weight_bytes - infos["fixed"].weight_bytes == 4 * layers * per_layer
    for got, want in zip(logits["measure"], logits["fixed"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert outs["measure"] == outs["fixed"]


def _graph_steps(ways: dict[str, tuple[str, ...]], built_in: dict[str, str]) -> tuple[dict, list]:
    """Steps of each kind for choose_graph_steps, each way a run that notes (kind, way)."""
    ran = []
    steps = {kind: (8, {way: lambda kind=kind, way=way: ran.append((kind, way)) for way in w},
                    built_in[kind]) for kind, w in ways.items()}
    return steps, ran


@pytest.mark.parametrize("faster", [1.01, 1.05])
def test_a_prompt_step_takes_its_graph_by_a_smaller_margin_than_decode_steps_leave_theirs(
        cache, monkeypatch, faster):
    """The built-in ways the worker passes: a prompt runs eagerly unless its graph is faster by
    more than GRAPH_PROMPT_MARGIN; a decode step keeps its graphs unless eager is faster by more
    than MARGIN. Both kinds' runs are timed."""
    monkeypatch.setattr(kc, "_time_step", lambda kind, candidates, rounds: (
        [run() for run in candidates.values()]
        and ({"graph": 1e-3 / faster, "eager": 1e-3} if kind == "prompt"
             else {"graph": 1e-3 * faster, "eager": 1e-3})))
    steps, ran = _graph_steps({"prompt": ("graph", "eager"), "decode": ("graph", "eager")},
                              {"prompt": "eager", "decode": "graph"})
    ways = kc.KernelChoice(torch.float32).choose_graph_steps(steps, (2, 32), "setup")
    assert kc.GRAPH_PROMPT_MARGIN < 1.05 < kc.MARGIN
    assert ways == {"prompt": "eager" if faster < kc.GRAPH_PROMPT_MARGIN else "graph",
                    "decode": "graph"}
    assert sorted(ran) == [("decode", "eager"), ("decode", "graph"), ("prompt", "eager"),
                           ("prompt", "graph")]


@pytest.mark.parametrize("graph_faster,way", [(1.05, "one-call"), (1.2, "graph")])
def test_a_decode_step_keeps_its_one_call_unless_another_way_is_faster_by_the_margin(
        cache, monkeypatch, graph_faster, way):
    """Where a float model's decode step can run as one C++ call, that is the way kept: the
    graphs must time faster by MARGIN to take its place; every way runs."""
    monkeypatch.setattr(kc, "_time_step", lambda kind, candidates, rounds: (
        [run() for run in candidates.values()]
        and {"graph": 1e-3 / graph_faster, "eager": 2e-3, "one-call": 1e-3}))
    steps, ran = _graph_steps({"decode": ("graph", "eager", "one-call")}, {"decode": "one-call"})
    ways = kc.KernelChoice(torch.float32).choose_graph_steps(steps, (2, 32), "setup")
    assert ways == {"decode": way}
    assert sorted(ran) == [("decode", "eager"), ("decode", "graph"), ("decode", "one-call")]


@pytest.mark.parametrize("decode_way", ["one-call", "graph"])
def test_kept_step_timings_name_the_eager_ways_only_where_no_kind_took_its_graphs(
        cache, monkeypatch, decode_way):
    """kept_eager_steps reads choose_graph_steps' kept timings and runs nothing: the ways of
    every kind where none took its graphs, else None; None too for another setup, another
    set of ways, or a kind never timed."""
    seconds = {"graph": 1e-3 if decode_way == "graph" else 3e-3, "eager": 2e-3, "one-call": 1.5e-3}
    monkeypatch.setattr(kc, "_time_step", lambda kind, candidates, rounds: (
        [run() for run in candidates.values()] and {way: seconds[way] for way in candidates}
        if kind == "decode" else {"graph": 2e-3, "eager": 1e-3}))
    ways = {"prompt": ("graph", "eager"), "decode": ("graph", "eager", "one-call")}
    built_in = {"prompt": "eager", "decode": "one-call"}
    steps, ran = _graph_steps(ways, built_in)
    timed = kc.KernelChoice(torch.float32).choose_graph_steps(steps, (2, 32), "setup")
    assert timed == {"prompt": "eager", "decode": decode_way}
    ran.clear()
    choice = kc.KernelChoice(torch.float32)
    kept = choice.kept_eager_steps(steps, (2, 32), "setup")
    assert ran == []
    if decode_way == "graph":
        assert kept is None and choice.picks == []
        return
    assert kept == timed
    assert [(p.op, p.kernel, p.from_disk) for p in choice.picks] == [
        ("graph-prompt", "eager", True), ("graph-decode", "one-call", True)]
    no_call, _ = _graph_steps({**ways, "decode": ("graph", "eager")}, built_in)
    prompts_only, _ = _graph_steps({"prompt": ways["prompt"]}, built_in)
    with_another, _ = _graph_steps({**ways, "other": ("graph", "eager")}, {**built_in, "other": "graph"})
    assert kc.KernelChoice(torch.float32).kept_eager_steps(steps, (2, 32), "other setup") is None
    assert kc.KernelChoice(torch.float32).kept_eager_steps(no_call, (2, 32), "setup") is None
    assert kc.KernelChoice(torch.float32).kept_eager_steps(with_another, (2, 32), "setup") is None
    assert kc.KernelChoice(torch.float32).kept_eager_steps(prompts_only, (2, 32), "setup") == {
        "prompt": "eager"}
