"""compile=True gives the eager engine's answers: logits and greedy tokens, with chunked
prefill, prefix hits and steps that mix prompts and decodes, through both kinds of graph (the
static decode graphs of each row bucket, padding rows included, and the dynamic-length prompt
graph), each one layer's graph shared by every layer; a setup where compiling fails falls back
to eager with a warning."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams, machine
from engine.loading.synthetic import random_token_ids
from engine.rank import kernel_choice

SHARED = random_token_ids(32, 300, seed=3)
PROMPTS = [SHARED + random_token_ids(n, 300, seed=n) for n in (5, 23)] + \
          [random_token_ids(n, 300, seed=n) for n in (1, 40, 71)]
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)
SETTINGS = dict(max_num_batched_tokens=48)  # the 71-token prompt runs in two chunks


def _run(llm: LLM) -> tuple[list[torch.Tensor], list[list[int]]]:
    logits = [o.logits for o in llm.prefill(PROMPTS)]  # the second prompt hits the first's prefix
    # one new token each after a 32-token prefix hit: a one-row-per-sequence step of 3 rows,
    # which the decode graph runs padded to 4; its logits come back
    logits += [o.logits for o in llm.prefill([SHARED + [t] for t in (7, 8, 9)])]
    return logits, [g.token_ids for g in llm.generate(PROMPTS, GREEDY)]  # mixed steps


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def eager(llama):
    """The reference: the same engine without compile, shared by the tests below."""
    with LLM(llama, compile=False, **SETTINGS) as llm:
        yield llm


def _graph_rows_timed(tmp_path: Path, faster: str, eager_steps: tuple[str, ...] = (),
                      one_call_decode: bool = False) -> pytest.MonkeyPatch:
    """The start-up timing of a graph's one-row products made to pick `faster`, in a timings
    folder of its own (a kept timing would be read instead); the decode graph's attention made
    to pick the fused kernel (so every decode graph here runs it); and the timing of whole
    steps made to keep every kind's graphs but `eager_steps`' (each candidate still runs
    once), or, `one_call_decode`, decode steps' layers in one C++ call (slowest otherwise)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PREFILL_ENGINE_CACHE", str(tmp_path))
    slower = {"multiply-and-sum": "torch", "torch": "multiply-and-sum"}[faster]
    mp.setattr(kernel_choice, "_time_in_graph", lambda kernels, weights: {faster: 1.0, slower: 2.0})
    mp.setattr(kernel_choice, "_time_decode_in_graph",
               lambda heads, block, context, dtype: {"tensor-math": 2.0, "fused": 1.0})

    def time_step(kind, candidates, rounds):
        for run in candidates.values():
            run()
        eager_first = kind in eager_steps
        seconds = {"graph": 2.0 if eager_first else 1.0, "eager": 1.0 if eager_first else 2.0}
        if "one-call" in candidates:
            seconds["one-call"] = 0.5 if one_call_decode else 3.0
        return seconds

    mp.setattr(kernel_choice, "_time_step", time_step)
    return mp


@pytest.fixture(scope="module")
def compiled(llama, tmp_path_factory):
    """One compiled engine for the tests that read it (its warm-up is most of their time); each
    sends prompts of its own, so none hits another's prefix. Its graphs' one-row products are
    multiply-and-sums (test_graph_rows_through_torch_matmul_match_eager takes the other pick)."""
    mp = _graph_rows_timed(tmp_path_factory.mktemp("timings"), "multiply-and-sum")
    try:
        with LLM(llama, compile=True, **SETTINGS) as llm:
            yield llm
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def want(eager):
    return _run(eager)


@pytest.mark.parametrize("tp", [1, 2])
def test_compiled_matches_eager(request, llama, want, tp):
    want_logits, want_tokens = want
    if tp > 1:
        request.getfixturevalue("ray_cluster")
        # two ranks compile at once on a 2-core machine, caches cold in a fresh clone: give the
        # warm-up (part of building the worker) more than the default 120 s; kernels fixed, so
        # the ranks' decode steps run their graphs (timed, they may take the C++ part calls:
        # test_quantized_layers.py's float ranks)
        with LLM(llama, tp=tp, compile=True, init_timeout_s=600,
                 **{**SETTINGS, "kernel_choice": "fixed"}) as llm:
            _check_compiled_run(llm, want_logits, want_tokens)
    else:
        _check_compiled_run(request.getfixturevalue("compiled"), want_logits, want_tokens)


def _check_compiled_run(llm: LLM, want_logits: list[torch.Tensor], want_tokens: list[list[int]]):
    assert all(info.compiled and info.warmup_s > 0 for info in llm.rank_info())
    logits, tokens = _run(llm)
    assert llm.cache_stats()["prefix_hit_tokens"] > 0
    graphs = {(t.graph, t.num_seqs) for t in llm.step_timings() if t.num_tokens == t.num_seqs}
    assert ("decode-4", 3) in graphs and ("decode-8", 5) in graphs, graphs
    assert "layers" in {t.graph for t in llm.step_timings()}
    with llm.tracing() as records:  # the walkthrough's path: eager, hooks see every op
        llm.prefill([PROMPTS[3]])
    assert {"qkv_proj", "attention", "down_proj"} <= {r["name"] for r in records}
    assert llm.step_timings()[-1].graph == ""  # the tracer's step: eager
    assert [g.token_ids for g in llm.generate(PROMPTS[:2], GREEDY)] == want_tokens[:2]
    assert llm.step_timings()[-1].graph == "decode-2"
    for got, expected in zip(logits, want_logits):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert tokens == want_tokens


def test_graph_rows_through_torch_matmul_match_eager(llama, want, tmp_path):
    """The pick recorded, and the decode graphs calling torch's matmul give eager's answers."""
    mp = _graph_rows_timed(tmp_path, "torch")
    try:
        with LLM(llama, compile=True, **SETTINGS) as llm:
            [line] = [k for k in llm.rank_info()[0].kernels if k.startswith("graph-linear")]
            assert ": torch (" in line
            _check_compiled_run(llm, *want)
    finally:
        mp.undo()


def test_quantized_weights_compiled_match_eager(llama, tmp_path):
    """weights="int4" through the graphs (the weight-only kernel for decode graphs of up to
    quantized.KERNEL_ROWS rows, the weight dequantized in the graph above that and in the
    prompt graph) gives eager int4's logits and tokens. Both take torch's kernels
    (kernel_choice="fixed"): timed apart, one could take the engine's int4 kernel and the other
    not, whose int16 rounding of x is past 1e-4 (test_quantized_rows runs that kernel in the
    graphs)."""
    with LLM(llama, weights="int4", compile=False, kernel_choice="fixed", **SETTINGS) as ref:
        want = _run(ref)
    mp = _graph_rows_timed(tmp_path, "multiply-and-sum")
    try:
        with LLM(llama, weights="int4", compile=True, kernel_choice="fixed", **SETTINGS) as llm:
            _check_compiled_run(llm, *want)
    finally:
        mp.undo()


@pytest.mark.parametrize("eager_kind", ["decode", "prompt"])
def test_a_step_kind_timed_faster_eagerly_runs_eagerly(llama, want, tmp_path, eager_kind):
    """After the warm-up a CPU rank times a prompt and a decode step through their graphs and
    eagerly (each candidate runs); a kind that timed faster eagerly runs eagerly from then on,
    whatever its width, the other keeps its graphs, rank_info says which, and the answers are
    eager's."""
    mp = _graph_rows_timed(tmp_path, "multiply-and-sum", eager_steps=(eager_kind,))
    try:
        with LLM(llama, compile=True, **SETTINGS) as llm:
            picks = {k.split(" ", 1)[0]: k.split(": ", 1)[1].split(" ", 1)[0]
                     for k in llm.rank_info()[0].kernels if k.startswith("graph-")}
            before = len(llm.step_timings())
            logits, tokens = _run(llm)
            steps = llm.step_timings()[before:]
    finally:
        mp.undo()
    graphs = {t.graph for t in steps}
    decode_steps = {t.graph for t in steps if t.num_tokens == t.num_seqs}  # one row each
    assert picks == {"graph-prompt": "eager" if eager_kind == "prompt" else "graph",
                     "graph-decode": "eager" if eager_kind == "decode" else "graph",
                     "graph-linear": "multiply-and-sum", "graph-decode-attention": "fused"}
    if eager_kind == "decode":  # nor does a decode step of 3 or 5 rows take the layers graph
        assert "layers" in graphs and decode_steps == {""}
    else:
        assert "layers" not in graphs and "decode-4" in graphs
    want_logits, want_tokens = want
    for got, expected in zip(logits, want_logits):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert tokens == want_tokens


def test_decode_steps_timed_fastest_as_one_call_run_so(llama, want, tmp_path):
    """A float model's decode steps may run their layers in one C++ call (the quantized layers'
    op, streaming the weights as they are): where that timed fastest after the warm-up, every
    decode step takes it (rank_info's graph-decode line says so, each step's graph is
    "layers-call"), prompts keep their graph, and the answers are eager's."""
    mp = _graph_rows_timed(tmp_path, "multiply-and-sum", one_call_decode=True)
    try:
        with LLM(llama, compile=True, **SETTINGS) as llm:
            kernels = llm.rank_info()[0].kernels
            [line] = [k for k in kernels if k.startswith("graph-decode ")]
            before = len(llm.step_timings())
            logits, tokens = _run(llm)
            steps = llm.step_timings()[before:]
    finally:
        mp.undo()
    assert ": one-call (" in line and "graph " in line and "eager " in line
    assert not [k for k in kernels if k.startswith("decode-steps")]  # not timed again
    assert {t.graph for t in steps if t.num_tokens == t.num_seqs} == {"layers-call"}
    assert "layers" in {t.graph for t in steps}
    want_logits, want_tokens = want
    for got, expected in zip(logits, want_logits):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert tokens == want_tokens


@pytest.mark.parametrize("graphs_lose", [True, False])
def test_a_default_start_builds_no_graphs_where_kept_timings_say_they_lost_every_kind(
        llama, want, tmp_path, monkeypatch, graphs_lose):
    """compile unset (the default) on a CPU: the first start builds the graphs and times each
    kind of step. Where no kind ran faster through them (decode steps as one C++ call; prompts
    eagerly, their graph 1 % faster: within the margin, eager kept), the next start of the
    same setup reads those timings and builds no graphs: nothing compiled or loaded, nothing
    timed, rank_info says why, each kind runs the way kept, and the answers are eager's, until
    the timings are a week old (REMEASURE_AFTER): that start builds and times them again. Where
    the prompt graph won (10 % faster), the next start builds the graphs again."""
    from engine.plan import COMPILE_ENV
    from engine.rank.compiled import CompiledModel

    monkeypatch.delenv(COMPILE_ENV, raising=False)  # the suite's conftest keeps unset compiles eager
    made, real_init = [], CompiledModel.__init__
    monkeypatch.setattr(CompiledModel, "__init__",
                        lambda self, *a, **k: (made.append(self), real_init(self, *a, **k))[1])
    mp = _graph_rows_timed(tmp_path, "multiply-and-sum")
    seconds = {"prompt": {"graph": 0.99 if graphs_lose else 0.9, "eager": 1.0},
               "decode": {"graph": 2.0, "eager": 3.0, "one-call": 1.0}}
    timed = []

    def time_step(kind, candidates, rounds):
        timed.append(kind)
        for run in candidates.values():
            run()
        return {way: seconds[kind][way] for way in candidates}

    mp.setattr(kernel_choice, "_time_step", time_step)
    try:
        with LLM(llama, **SETTINGS) as llm:
            assert llm.rank_info()[0].compiled and len(made) == 1
        assert sorted(timed) == ["decode", "prompt"]
        timed.clear()
        with LLM(llama, **SETTINGS) as llm:
            info = llm.rank_info()[0]
            logits, tokens = _run(llm)
            steps = llm.step_timings()
        second = (len(made), list(timed))
        if graphs_lose:  # the timings out of date (over REMEASURE_AFTER old): built, timed again
            mp.setattr(machine, "REMEASURE_AFTER", -1.0)
            with LLM(llama, **SETTINGS) as llm:
                assert llm.rank_info()[0].compiled and len(made) == 2
            assert sorted(timed) == ["decode", "prompt"]
    finally:
        mp.undo()
    graphs = {t.graph for t in steps}
    notes = [k for k in info.kernels if k.startswith("graphs: none built")]
    if graphs_lose:
        assert not info.compiled and second == (1, []) and notes
        assert all("kept on disk" in k for k in info.kernels if k.startswith("graph-"))
        assert {t.graph for t in steps if t.num_tokens == t.num_seqs} == {"layers-call"}
        assert graphs == {"", "layers-call"}
    else:
        assert info.compiled and second[0] == 2 and not notes
        assert "layers" in graphs and "layers-call" in graphs
    want_logits, want_tokens = want
    for got, expected in zip(logits, want_logits):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert tokens == want_tokens


def test_wide_decode_steps_run_the_layers_graph(eager, compiled):
    """A decode step of more sequences than the largest bucket runs the dynamic-length graph,
    and gives eager's tokens."""
    prompts = [random_token_ids(3 + i, 300, seed=100 + i) for i in range(10)]
    few = SamplingParams(max_tokens=4, ignore_eos=True)
    want = [g.token_ids for g in eager.generate(prompts, few)]
    before = len(compiled.step_timings())
    got = [g.token_ids for g in compiled.generate(prompts, few)]
    decode_steps = [t for t in compiled.step_timings()[before:] if t.num_tokens == t.num_seqs == 10]
    assert decode_steps and {t.graph for t in decode_steps} == {"layers"}
    assert got == want


def test_nothing_compiles_inside_requests(eager, compiled):
    """After the warm-up, steps of every kind (prompts of 1, 2 and 3 tokens, chunks, decode
    batches of each bucket, a prefix hit, scoring) run without compiling anything, and give
    eager's tokens (a 2-token prompt step once hit a recompile that failed the request)."""
    from torch._dynamo.utils import counters

    prompts = [random_token_ids(n, 300, seed=200 + n) for n in (1, 2, 3, 17, 70)]
    few = SamplingParams(max_tokens=6, ignore_eos=True)
    want = [g.token_ids for g in eager.generate(prompts, few)]
    want_one = eager.generate([prompts[1]], few)[0].token_ids
    graphs_before = counters["stats"]["unique_graphs"]
    got = [g.token_ids for g in compiled.generate(prompts, few)]
    got_one = compiled.generate([prompts[1]], few)[0].token_ids  # its 2-token prompt step alone
    compiled.score([prompts[3]])
    assert counters["stats"]["unique_graphs"] == graphs_before
    assert got == want and got_one == want_one


def _graphs(compiled) -> dict:
    """Every graph of a CompiledModel, by name."""
    return {"layer": compiled._layer,
            **{f"decode{r}": g for r, g in compiled._decode_layer.items()},
            **{f"head{r}": g for r, g in compiled._decode_head.items()}}


def test_one_graph_serves_every_layer_and_later_starts_load_it(tiny_model_dir, tmp_path,
                                                               monkeypatch):
    """A six-layer model compiles one graph of each layer function, whatever its depth (the
    layer index symbolic from layer 0 on), and one head graph per bucket of 1-2 rows, and keeps
    each on disk; the next start of the same setup loads every one and compiles none. Both
    answer as eager does, so every layer run through a shared graph read its own weights and
    its own slice of the cache (decode steps skip the guards once every layer has run)."""
    from engine.rank.compiled import CompiledModel

    made, real_init = [], CompiledModel.__init__
    monkeypatch.setattr(CompiledModel, "__init__",
                        lambda self, *a, **k: (made.append(self), real_init(self, *a, **k))[1])
    deep = str(tiny_model_dir("deep"))
    with LLM(deep, compile=False, **SETTINGS) as llm:
        want_logits, want_tokens = _run(llm)
    mp = _graph_rows_timed(tmp_path, "multiply-and-sum")
    compiles = []
    try:
        for _ in range(2):
            with LLM(deep, compile=True, **SETTINGS) as llm:
                logits, tokens = _run(llm)
                decode_graphs = {t.graph for t in llm.step_timings()
                                 if t.graph.startswith("decode")}
            graphs = _graphs(made[-1])
            compiles.append({name: g.compiles for name, g in graphs.items()})
            assert not any(g.fell_back for g in graphs.values())
            assert {"decode-4", "decode-8"} <= decode_graphs
            for got, expected in zip(logits, want_logits):
                torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
            assert tokens == want_tokens
    finally:
        mp.undo()
    # the head's graphs: 1 and 2 rows; 4 and 8 run it eagerly
    names = ["layer", "decode1", "decode2", "decode4", "decode8", "head1", "head2"]
    assert compiles == [dict.fromkeys(names, 1), dict.fromkeys(names, 0)], compiles
    assert sorted(f.name.split("-")[0] for f in (tmp_path / "graphs").iterdir()) == sorted(names)


def test_short_context_warms_up_within_it(llama):
    """The warm-up's made-up steps stay inside max_model_len (they used positions up to 48,
    so a 16-token engine failed to start, compiled or not)."""
    prompt, few = random_token_ids(5, 300, seed=7), SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(llama, compile=False, max_model_len=16) as eager:
        want = eager.generate([prompt], few)[0].token_ids
    with LLM(llama, compile=True, max_model_len=16) as llm:
        assert llm.rank_info()[0].compiled
        assert llm.generate([prompt], few)[0].token_ids == want
        assert {t.graph for t in llm.step_timings()} == {"layers", "decode-1"}


def test_a_compiled_engine_of_another_model_in_this_process_compiles_too(tiny_model_dir,
                                                                          compiled, caplog):
    """After `compiled` (llama) a compiled engine of another model in this process (mistral:
    another head size, so another attention scale) compiles too and answers as its eager engine
    does. Dynamo records per code name which sizes and floats have varied; one name for both
    models' graphs made the second model's floats symbolic, and its compile failed."""
    other = str(tiny_model_dir("mistral"))
    prompts = [random_token_ids(n, 257, seed=n) for n in (9, 30)]  # its vocabulary
    with LLM(other, compile=False) as llm:
        want = [g.token_ids for g in llm.generate(prompts, GREEDY)]
    with caplog.at_level(logging.WARNING, logger="engine"), LLM(other, compile=True) as llm:
        assert llm.rank_info()[0].compiled
        assert [g.token_ids for g in llm.generate(prompts, GREEDY)] == want
    assert "compiling the layers failed" not in caplog.text


def test_compile_failure_falls_back_to_eager(llama, want, caplog, monkeypatch, tmp_path):
    """A backend that cannot compile this setup (here: one that always raises, as inductor
    does on a file in its cache cut short by a compile killed midway): the engine warns, names
    the folder to delete, and runs eagerly. Last of the engine tests in this file: it resets
    dynamo, which the shared compiled engine must not meet afterwards. Its cache folder is
    its own: a graph kept by an earlier start would load without the backend."""
    import torch._dynamo

    folder = kernel_choice.keep_compiled_code()  # where this process's inductor writes
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(tmp_path))

    def broken_backend(graph, example_inputs):
        raise ImportError(f"{folder}/oo/c00.main.so: file too short")

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: real_compile(
        fn, backend=broken_backend, dynamic=True, fullgraph=True))
    want_logits, want_tokens = want
    torch._dynamo.reset()  # compile afresh, with the broken backend
    try:
        with caplog.at_level(logging.WARNING, logger="engine"):
            with LLM(llama, compile=True, **SETTINGS) as llm:
                assert not llm.rank_info()[0].compiled
                logits, tokens = _run(llm)
                assert {t.graph for t in llm.step_timings()} == {""}
    finally:
        torch._dynamo.reset()
    assert "running eagerly instead" in caplog.text
    assert f"delete {folder} to compile afresh" in caplog.text
    assert tokens == want_tokens
    torch.testing.assert_close(logits[0], want_logits[0], atol=1e-5, rtol=1e-5)


def test_inductor_keeps_its_code_in_the_engines_cache_folder(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    from engine.rank.compiled import CompiledModel

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(tmp_path))
    CompiledModel(torch.nn.Linear(2, 2))
    assert inductor_cache_dir() == str(tmp_path / "inductor")  # where torch will write
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    CompiledModel(torch.nn.Linear(2, 2))
    assert inductor_cache_dir() == str(tmp_path / "mine")  # a folder chosen before is kept


def test_vector_isa_probes_run_once_per_machine(tmp_path, monkeypatch):
    """inductor's probes of the vector ISAs the CPU claims run on a machine's first compiled
    start; once all passed, later starts (a record for this CPU, torch and compiler) tell
    inductor so without probing. A claimed ISA that failed its probe is never recorded or
    trusted, and a choice the user made (TORCHINDUCTOR_VEC_ISA_OK) stands."""
    from torch._inductor import config as inductor_config, cpu_vec_isa

    from engine.rank.compiled import trust_probed_vector_isas

    flags = cpu_vec_isa.x86_isa_checker()
    claimed = [isa for isa in cpu_vec_isa.supported_vec_isa_list
               if all(flag in flags for flag in str(isa).split())]
    assert claimed, "an x86 CPU claims AVX2 at least"
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(tmp_path))
    record = tmp_path / "vector_isas.json"
    probes = []

    def probing(passed):
        monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list",
                            lambda: probes.append(1) or passed)

    def start(user_choice=None):
        inductor_config.cpp.vec_isa_ok = user_choice  # (monkeypatch breaks config proxies)
        trust_probed_vector_isas()
        return inductor_config.cpp.vec_isa_ok

    with inductor_config.patch({"cpp.vec_isa_ok": None}):  # restored afterwards
        probing(claimed[1:])  # the widest claimed ISA failed its probe
        assert start() is None and not record.exists() and len(probes) == 1
        probing(claimed)
        assert start() is True and len(probes) == 2
        assert list(json.loads(record.read_text()).values()) == [[str(isa) for isa in claimed]]
        assert start() is True and len(probes) == 2  # kept: no probe
        assert start(user_choice=False) is False and len(probes) == 2
        record.write_text(json.dumps({"another CPU": [str(isa) for isa in claimed]}))
        assert start() is True and len(probes) == 3  # no record for this machine: probed again
