"""The walkthrough's numbers against a count by hand from the model's config, and its files."""
from __future__ import annotations

import ctypes
import json
import os

import pytest

from engine import LLM
from engine.observe.hardware import Hardware, copy_buffers
from parallel.partition import even_ranges, partition_heads

HW = Hardware("test-roof", peak_flops=1e11, peak_bytes=1e10)  # ridge at 10 FLOP/byte


def _resident_fraction(t) -> float:
    """The share of a tensor's pages that are in memory, from mincore(2): a page never
    written is not resident, whatever the allocator did before (RSS can stay flat when the
    allocator hands back pages it freed earlier, so the process's total says nothing)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.nbytes - start
    pages = (length + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    status = libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec)
    assert status == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec) / pages


def test_the_measured_roof_copies_from_memory_that_was_written():
    """A CPU roof's bandwidth comes from a 64 MiB copy; a source never written reads the
    kernel's zero page from cache (its pages are not even resident), which counted 1.7x the
    memory's bandwidth on the Zen 4 EPYC."""
    src, dst = copy_buffers("cpu")
    assert src.nbytes == dst.nbytes == 64 * 2**20
    assert _resident_fraction(src) >= 0.99  # the source's pages are in memory
    assert bool((src == 1).all())


def hand_count(cfg: dict, tokens: int, tp: int = 1, elem: int = 4) -> tuple[int, int]:
    """FLOPs and bytes of a prefill of `tokens` tokens with no cached prefix, summed over ranks,
    written out from the conventions in engine/observe/costs.py: 2 FLOPs per multiply-add; element-wise
    FLOPs per output element: RMSNorm 4 (+1 with the residual add), RoPE 3, SiLU·mul 4 (in the
    gate/up projection's op, which writes only its result). The last
    layer's o_proj, post-attention norm and MLP run the sampled row only (a prompt of 2 or
    more)."""
    T, d, L, hd = tokens, cfg["hidden"], cfg["layers"], cfg["head_dim"]
    V, ffn = cfg["vocab"], cfg["ffn"]
    flops = nbytes = 0
    heads = partition_heads(cfg["heads"], cfg["kv_heads"], tp)
    for r in range(tp):
        q, kv = heads[r].num_q_heads, heads[r].num_kv_heads
        f = even_ranges(ffn, tp)[r][1] - even_ranges(ffn, tp)[r][0]
        v = even_ranges(V, tp)[r][1] - even_ranges(V, tp)[r][0]
        qkv = (q + 2 * kv) * hd
        nbytes += 4 * T + 2 * T * d * elem  # embedding: int32 ids, rows read, rows written
        for layer in range(L):
            m = 1 if layer == L - 1 and T >= 2 else T  # the rows of its post-attention part
            norm_flops, norm_bytes = (4, 2) if layer == 0 else (5, 4)  # layer 0 has no residual yet
            flops += norm_flops * T * d + 5 * m * d  # input norm, post-attention norm
            nbytes += (norm_bytes * T * d + d) * elem + (4 * m * d + d) * elem
            flops += 2 * T * d * qkv  # qkv
            nbytes += (T * d + d * qkv + T * qkv) * elem + (qkv * elem if cfg["bias"] else 0)
            flops += 3 * T * (q + kv) * hd  # rope
            nbytes += 2 * T * (q + kv) * hd * elem + 2 * T * (hd // 2) * 4
            nbytes += 2 * 2 * T * kv * hd * elem  # kv write
            flops += 4 * q * hd * T * (T + 1) // 2  # causal attention
            nbytes += 2 * T * q * hd * elem + 2 * T * kv * hd * elem
            flops += 2 * m * q * hd * d  # o_proj
            nbytes += (m * q * hd + q * hd * d + m * d) * elem
            flops += 2 * m * d * 2 * f + 4 * m * f + 2 * m * f * d  # gate/up, silu·mul, down
            # gate/up applies its SiLU·mul itself: reads x and W, writes [m, f]
            nbytes += (m * d + 2 * f * d + m * f) * elem
            nbytes += (m * f + f * d + m * d) * elem
        flops += 5 * d + 2 * d * v  # final norm (one row, with residual), LM head on it
        nbytes += (4 * d + d) * elem + (d + d * v + v) * elem
    flops += V  # sampling, on rank 0 only
    nbytes += 4 * V
    return flops, nbytes


def _cfg(llm: LLM) -> dict:
    mc = llm.model_config
    return {"hidden": mc.hidden_size, "layers": mc.num_layers, "head_dim": mc.head_dim,
            "heads": mc.num_heads, "kv_heads": mc.num_kv_heads, "ffn": mc.intermediate_size,
            "vocab": mc.vocab_size, "bias": mc.qkv_bias}


def test_smollm2_counts_match_hand_count(smollm2_llm):
    from engine.observe.prefill_walk import run_walkthrough

    prompt = "The KV cache holds the keys and values of every prompt position."
    report = run_walkthrough(smollm2_llm, prompt, HW, decode_tokens=2)
    tokens = len(smollm2_llm.tokenizer.encode(prompt))
    assert report.prefill.tokens == tokens
    assert (report.prefill.total_flops, report.prefill.total_bytes) == hand_count(_cfg(smollm2_llm), tokens)
    # every op's bound follows from its intensity against the ridge (10 FLOP/byte here)
    for op in report.to_dict()["prefill"]["ops"]:
        assert op["bound"] == ("compute" if op["bytes"] and op["flops"] / op["bytes"] >= 10 else "memory")
    first = report.first_token
    assert first["candidates"][0]["id"] == first["id"]
    assert 0 < first["candidates"][0]["prob"] <= 1


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_tiny_model_counts_match_hand_count(tiny_model_dir, name):
    from engine.observe.prefill_walk import run_walkthrough

    with LLM(str(tiny_model_dir(name))) as llm:
        ids = list(range(3, 3 + 40))
        report = run_walkthrough(llm, ids, HW, decode_tokens=4)
        flops, nbytes = hand_count(_cfg(llm), len(ids))
        assert report.prefill.total_flops == flops
        assert report.prefill.total_bytes == nbytes
        d = report.to_dict()
        layers = llm.model_config.num_layers
        assert sum(1 for op in d["prefill"]["ops"] if op["name"] == "attention") == layers
        assert {op["layer"] for op in d["prefill"]["ops"] if op["name"] == "qkv_proj"} == set(range(layers))
        # decode: one token reads every weight once, so its intensity collapses
        assert d["decode"]["intensity"] < d["prefill"]["intensity"] / 5


def test_cache_versus_recompute_counts_n_times_more_compute(tiny_model_dir):
    from engine.observe.costs import forward_flops
    from engine.observe.prefill_walk import run_walkthrough

    with LLM(str(tiny_model_dir("qwen2"))) as llm:
        ids, n = list(range(3, 3 + 60)), 6
        s = run_walkthrough(llm, ids, HW, decode_tokens=n).cache_savings
        mc = llm.model_config
        # without the cache, step i recomputes the whole T + i tokens
        assert s["flops_recompute"] == sum(forward_flops(mc, 60 + i, 60 + i) for i in range(n))
        assert s["flops_recompute"] > 0.9 * n * s["flops_with_cache"]
        assert s["time_recompute_s"] > 0 and s["time_with_cache_s"] > 0


def test_tp2_shapes_follow_the_head_partition(ray_cluster, tiny_model_dir):
    from engine.observe.prefill_walk import run_walkthrough

    with LLM(str(tiny_model_dir("uneven")), tp=2) as llm:
        ids = list(range(3, 3 + 20))
        report = run_walkthrough(llm, ids, HW, decode_tokens=2)
        cfg = _cfg(llm)
        assert report.prefill.total_flops == hand_count(cfg, 20, tp=2)[0] + _all_reduce_flops(cfg, 20)
        parts = partition_heads(cfg["heads"], cfg["kv_heads"], 2)
        for op in report.to_dict()["prefill"]["ops"]:
            if op["name"] == "qkv_proj":
                width = (parts[op["rank"]].num_q_heads + 2 * parts[op["rank"]].num_kv_heads) * cfg["head_dim"]
                assert op["shapes"] == f"[20, {cfg['hidden']}] x [{cfg['hidden']}, {width}]"
        assert {op["rank"] for op in report.prefill.ops} == {0, 1}
        kv = report.kv_cache
        assert [r["kv_heads"] for r in kv["ranks"]] == [p.kv_heads for p in parts]


def _all_reduce_flops(cfg: dict, tokens: int) -> int:
    """Two all-reduces of [T, d] per layer plus the embedding's, the last layer's two (o_proj's
    and the MLP's) of the sampled row only; through shared memory each rank of TP=2 adds the
    other's T·d elements to its own, so both ranks together add 2·T·d per all-reduce."""
    return 2 * ((2 * cfg["layers"] - 1) * tokens + 2) * cfg["hidden"]


def test_app_writes_json_trace_and_roofline(tmp_path, tiny_model_dir):
    from hydra import compose, initialize_config_dir
    from rich.console import Console

    from launcher.build_engine import CONF_DIR
    from launcher.walkthrough import run

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("walkthrough", overrides=[f"model.path={tiny_model_dir('qwen2')}",
                                                 "prompt=[5,6,7,8,9,10,11,12]", "decode_tokens=2",
                                                 f"out_dir={tmp_path}"])
    console = Console(record=True, width=150)
    files = run(cfg, console)
    text = console.export_text()
    for heading in ("1. The prompt", "3. Prefill of 8 tokens", "4. KV cache", "6. One decode step",
                    "7. What the cache saved", "8. TTFT"):
        assert heading in text
    data = json.loads(files["json"].read_text())
    assert {"prefill", "decode"} <= data.keys()
    assert data["prefill"]["total_flops"] == sum(op["flops"] for op in data["prefill"]["ops"])
    trace = json.loads(files["trace"].read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 and "ts" in e for e in spans)
    assert files["roofline"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_app_appends_results_and_draws_plots(tmp_path, tiny_model_dir):
    from hydra import compose, initialize_config_dir

    from launcher.bench import main as bench_main
    from launcher.build_engine import CONF_DIR

    results = tmp_path / "results.jsonl"
    for length in (16, 32):
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            cfg = compose("bench", overrides=[f"model.path={tiny_model_dir('qwen2')}",
                                               f"prompt_len={length}", "repeats=1", "decode_tokens=3",
                                               f"results={results}", f"plots_dir={tmp_path / 'plots'}"])
        bench_main.__wrapped__(cfg)  # the function under @hydra.main, with a composed config
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["prompt_len"] for r in rows] == [16, 32]
    for r in rows:
        assert r["prefill_tok_s"] == pytest.approx(r["prompt_len"] / r["ttft_s"])
        assert r["transformers_ttft_s"] > 0 and r["speedup_vs_transformers"] > 0
        assert sum(n["ranks"] for n in r["nodes"].values()) == 1
    for png in ("ttft_vs_prompt_len.png", "tp_scaling.png"):
        assert (tmp_path / "plots" / png).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("overlap", [False, True])
def test_report_shows_exposed_and_total_communication(ray_cluster, tmp_path, tiny_model_dir,
                                                      overlap):
    """TP=2: the terminal text and the HTML page give rank 0's communication per phase, in flight
    and exposed; exposed never exceeds in flight, and without overlap they are the same time."""
    import re

    from hydra import compose, initialize_config_dir
    from rich.console import Console

    from launcher.build_engine import CONF_DIR
    from launcher.walkthrough import run

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("walkthrough", overrides=[
            f"model.path={tiny_model_dir('uneven')}", "prompt=[" + ",".join(map(str, range(3, 43)))
            + "]", "decode_tokens=1", "short_len=0", f"out_dir={tmp_path}", "parallel.tp=2",
            f"parallel.overlap_comm={str(overlap).lower()}", "engine.enable_prefix_caching=false"])
    console = Console(record=True, width=150)
    files = run(cfg, console)
    comm = json.loads(files["json"].read_text())["comm"]
    line = re.compile(r"communication on rank 0, (prefill|decode): ([\d.]+) ms in flight in "
                      r"total, ([\d.]+) ms exposed")
    for text in (console.export_text(), files["html"].read_text()):
        shown = {m[0]: (float(m[1]), float(m[2])) for m in line.findall(text)}
        assert shown.keys() == {"prefill", "decode"}, text
        for phase, (total_ms, exposed_ms) in shown.items():
            assert total_ms == pytest.approx(comm[phase]["total_s"] * 1e3, abs=0.006)
            assert exposed_ms == pytest.approx(comm[phase]["exposed_s"] * 1e3, abs=0.006)
    for phase in ("prefill", "decode"):
        assert 0 < comm[phase]["exposed_s"] <= comm[phase]["total_s"]
        if not overlap:  # every collective blocks: all of it is exposed
            assert comm[phase]["exposed_s"] == pytest.approx(comm[phase]["total_s"])
    if overlap:  # each half's all-reduce was in flight while the other half computed
        assert comm["prefill"]["exposed_s"] < comm["prefill"]["total_s"]
    claim = {c["key"]: c for c in json.loads(files["json"].read_text())["claims"]}
    measured = claim["all_reduce_per_layer"]["measured"]
    assert measured["comm_total_s"] == comm["prefill"]["total_s"]
