"""The CUDA path of a rank, executed without a GPU (tests/fake_cuda.py, run by
tests/fake_cuda_run.py in a process of its own): a rank builds on `cuda` with its device index,
sizes its KV cache from the GPU's free memory, and steps prompts and decodes on the torch and
Triton backends with no device mismatch, no host sync, one pinned host->device copy per step,
collectives timed on the device, and no Triton compile or autotune inside a request."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fake_cuda_run import BLOCK, FREE_BYTES, SCENARIOS, STEPS

ROOT = Path(__file__).resolve().parents[1]
GPU_HEADROOM = 0.15  # the engine's documented share of free memory kept for activations


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict:
    model = tiny_model_dir("llama")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.fake_cuda_run", str(model),
                           str(tmp_path_factory.mktemp("fake_cuda_guard"))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


NAMES = [f"{b}-tp{tp}-rank{r}" for b, tp, r in SCENARIOS]


def _ok(runs: dict, name: str) -> dict:
    run = runs[name]
    assert "error" not in run, f"{name}: {run.get('error')}\n{run.get('traceback')}"
    return run


@pytest.mark.parametrize("name", NAMES)
def test_rank_builds_on_its_indexed_device(runs, name):
    run = _ok(runs, name)
    assert run["set_device"] == [0]  # an index, not a bare "cuda" (which torch refuses)
    assert run["devices"] == ["cuda:0"]  # every parameter, buffer and the KV cache


@pytest.mark.parametrize("name", NAMES)
def test_kv_cache_is_sized_from_free_gpu_memory(runs, name, tiny_model_dir):
    """Hand count: (free - this rank's weights) less the headroom, over one block's bytes."""
    run = _ok(runs, name)
    cfg = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    tp = int(name.split("-tp")[1][0])
    kv_heads = cfg["num_key_value_heads"] // tp
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    block_bytes = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 2 * BLOCK  # bf16
    params = run["weight_bytes_per_rank"] * tp  # even split of a tiny model's bf16 weights
    expected = int((FREE_BYTES - params // tp) * (1 - GPU_HEADROOM)) // block_bytes
    assert abs(run["num_blocks"] - expected) <= 1
    assert run["cache_shape"] == [2, cfg["num_hidden_layers"], run["num_blocks"], BLOCK,
                                  kv_heads, head_dim]


@pytest.mark.parametrize("name", NAMES)
def test_a_released_rank_hands_its_cache_back_to_the_driver(runs, name):
    """Shutdown's release: no blocks left, and torch's cached blocks emptied, since the next
    engine sizes its cache from what the driver reports free."""
    release = _ok(runs, name)["release"]
    assert release["cache_shape"][2] == 0
    assert release["cuda_calls"] == ["cuda:empty_cache"]


@pytest.mark.parametrize("name", NAMES)
def test_steps_make_one_pinned_copy_and_no_host_sync(runs, name):
    run = _ok(runs, name)
    assert [s["name"] for s in run["steps"]] == [s[0] for s in STEPS]
    for step in run["steps"]:
        where = f"{name} {step['name']} of {step['num_tokens']} tokens"
        assert [s["stack"] for s in step["syncs"]] == [], where
        assert len(step["h2d"]) == 1, (where, step["h2d"])
        assert step["h2d"][0]["pinned"] and step["h2d"][0]["non_blocking"], where
        rank0 = name.endswith("rank0")
        assert step["d2h"] == (1 if rank0 else 0), where  # rank 0 reads its logits, no more
        assert step["cuda_calls"].count("cuda:synchronize") == (1 if rank0 else 0), where
        if rank0:
            assert len(step["tokens"]) == step["num_seqs"], where


@pytest.mark.parametrize("name", [n for n in NAMES if "-tp2-" in n])
def test_collectives_are_timed_with_cuda_events(runs, name):
    """TP=2 runs its collectives through torch's "fake" process group: an embedding and two
    per layer all-reduces plus the logits gather, each between two events, 1 ms apart on the
    fake device clock; rank 0 reports them as exposed and total communication."""
    run = _ok(runs, name)
    collectives = 1 + 2 * 2 + 1  # the tiny llama has 2 layers
    for step in run["steps"]:
        assert step["cuda_calls"].count("cuda:Event.record") == 2 * collectives
        if name.endswith("rank0"):
            assert step["comm_exposed_s"] == pytest.approx(collectives * 1e-3)
            assert step["comm_total_s"] == pytest.approx(collectives * 1e-3)


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("triton")])
def test_triton_never_compiles_or_tunes_inside_a_request(runs, name):
    """Every launch a step makes has a specialisation the warm-up already compiled (Triton's own
    rule for integer arguments), the autotuner never benchmarks during a step, and every tensor
    a kernel gets is on the rank's device."""
    run = _ok(runs, name)
    warm = {(x["kernel"], tuple(x["specialization"])) for x in run["build"]["launches"]}
    for step in run["steps"]:
        assert step["launches"], step["name"]
        for launch in step["launches"]:
            assert launch["devices"] == ["cuda:0"], launch
            assert (launch["kernel"], tuple(launch["specialization"])) in warm, launch
        assert step["autotune_benches"] == []


def test_warm_up_tunes_every_token_bucket(runs):
    """The first Triton engine in the process tunes the flash prefill once per token bucket a
    step can fall in (max_num_batched_tokens 8192: buckets 16 .. 16384), every tile of the
    search space in each."""
    from engine.rank.kernels.launch_config import PREFILL_TUNE_SPACE, TUNE_TOKEN_BUCKETS

    benches = _ok(runs, "triton-tp1-rank0")["build"]["autotune_benches"]
    assert len(benches) == len(TUNE_TOKEN_BUCKETS) * len(PREFILL_TUNE_SPACE)
    assert {b["kernel"] for b in benches} == {"_flash_prefill_kernel"}


def test_cuda_graphs_capture_every_bucket_and_width_in_one_go(runs):
    """Buckets 1/2/4/8 x table widths 2..16 (max_model_len 256, blocks of 16), captured with no
    host sync and no host->device copy inside (neither can be captured)."""
    run = runs["cuda-graphs"]
    assert run["usable"]
    assert run["captured"] == [[r, w] for r in (1, 2, 4, 8) for w in (2, 4, 8, 16)]
    capture = run["capture"]
    assert capture["syncs"] == [] and capture["h2d"] == [] and capture["d2h"] == 0
    assert capture["events"].count("cuda:graph.capture_begin") == 16


def test_decode_steps_replay_into_their_graphs_static_inputs(runs, tiny_model_dir):
    """Each decode step (CompiledModel.decode_context) fills the static buffer of the graph for
    (its row bucket, the power of two >= its table width) with one pinned copy, and
    decode_logits replays it (every row of the bucket: the worker keeps the sampled ones);
    9 sequences are more than the largest bucket: the worker runs them eagerly."""
    from tests.fake_cuda_run import GRAPH_STEPS

    run = runs["cuda-graphs"]
    vocab = json.loads((tiny_model_dir("llama") / "config.json").read_text())["vocab_size"]
    expected = {(37, 2): "2x4", (140, 3): "4x16", (5, 1): "1x2"}  # by hand: ceil(ctx/16) -> 2^k
    for (start, seqs), step in zip(GRAPH_STEPS, run["replays"]):
        assert step["syncs"] == []
        if (start, seqs) not in expected:
            assert step["rows"] is None and step["graph_replays"] == 0  # an eager step
            continue
        assert step["graph_replays"] == 1
        assert step["into"] == [run["input_buffers"][expected[(start, seqs)]]]
        assert step["h2d"][0]["pinned"] and step["h2d"][0]["non_blocking"]
        assert step["logits_shape"] == [int(expected[(start, seqs)].split("x")[0]), vocab]


def test_without_graphs_decode_runs_the_uncaptured_graph(runs):
    step = runs["cuda-graphs"]["uncaptured"]
    assert step["graph_replays"] == 0 and step["logits_shape"][0] == 2
    assert len(step["h2d"]) == 1 and step["syncs"] == []  # padded_decode's own packed copy


def test_a_compiled_gpu_rank_runs_its_prompts_the_way_that_timed_faster(runs):
    """compile=True on one GPU, every start-up step the engine's own but the compiler's: after
    the warm-up and the CUDA graphs' capture, the prompt kind alone is timed through its graphs
    and eagerly (decode steps replay CUDA graphs), at the most tokens a step may hold up to
    GPU_GRAPH_TIMING_TOKENS, kept under a key naming the GPU. Eager won the stand-in timing:
    prompt steps then run eagerly, decode steps still replay their graphs, none syncs."""
    from engine.rank.worker import GPU_GRAPH_TIMING_TOKENS
    from tests.fake_cuda import FakeGpu

    run = _ok(runs, "compiled")
    assert run["time_graph_steps"]
    assert run["timed"] == [{"kind": "prompt", "candidates": ["eager", "graph"]}]
    assert run["graph_steps"] == {"prompt": False, "decode": True}
    rows = min(GPU_GRAPH_TIMING_TOKENS, 256 - 1)  # max_model_len 256, one token to sample
    [pick] = run["picks"]
    assert pick.startswith("graph-prompt ") and f" at {rows} rows: eager " in pick
    [key] = run["kept_keys"]
    assert "|graph-prompt|torch.bfloat16|" in key and f"|{FakeGpu().name}|" in key
    assert run["captured"] == [[r, w] for r in (1, 2, 4, 8) for w in (2, 4, 8, 16)]
    for (name, _, _, seqs), step in zip(STEPS, run["steps"]):
        want = "" if name == "prefill" else f"decode-{1 << (seqs - 1).bit_length()}"
        assert step["graph"] == want, (name, seqs, step)
        assert step["graph_replays"] == (name == "decode") and step["syncs"] == 0
