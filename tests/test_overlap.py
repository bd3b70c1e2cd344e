"""overlap_comm: a step split into two interleaved micro-batches gives the unsplit step's results.

References: the split metadata against a hand count; the split forward against the unsplit one
on the same worker at every split point (one rank); and TP=2/3 on Ray actors with overlap on
against overlap off (several prompts per step, chunked prefill, decode)."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, ConfigError, SamplingParams
from engine.loading.synthetic import random_token_ids as _ids
from engine.rank.overlap import split_step, with_halves

PROMPTS = [(45, 3), (17, 4), (30, 5)]  # (length, seed): nothing divides evenly


def test_split_step_by_hand():
    # a fresh 5-token prompt, a 4-token chunk after 3 cached tokens, a decode token at 19
    first, second = split_step([0, 5, 9, 10], [5, 7, 20], [[1], [2], [3]], list(range(10)), 6)
    # rows 0..5: all of the prompt, and the chunk's first token (position 3: context 4)
    assert first == ([0, 5, 6], [5, 4], [[1], [2]], [0, 1, 2, 3, 4, 5])
    # rows 6..9: the chunk's last three (context 7, reading the cache) and the decode token
    assert second == ([0, 3, 4], [7, 20], [[2], [3]], [6, 7, 8, 9])
    # a split on a sequence boundary cuts nothing
    first, second = split_step([0, 5, 9], [5, 4], [[1], [2]], list(range(9)), 5)
    assert first == ([0, 5], [5], [[1]], [0, 1, 2, 3, 4])
    assert second == ([0, 4], [4], [[2]], [5, 6, 7, 8])


@pytest.fixture(scope="module", params=["torch", "triton"])
def worker(tiny_model_dir, request):
    """One rank on either attention backend (Triton under the interpreter on a CPU)."""
    from engine.config import EngineConfig
    from engine.loading.checkpoint import open_checkpoint
    from engine.plan import make_plan
    from engine.rank.worker import Worker

    path = str(tiny_model_dir("uneven"))
    ckpt = open_checkpoint(path)
    cfg = EngineConfig(model=path, attention_backend=request.param)
    return Worker(make_plan(cfg, path, ckpt.config), checkpoint=ckpt)


def _batch(ids, positions, cu, lens, tables, slot_mapping):
    from engine.batch import Batch

    return Batch(ids, positions, cu, lens, slot_mapping, tables, list(range(len(ids))))


def _context(worker, batch):
    """The step's plain (unsplit, eager) context, as the worker builds it."""
    from engine.rank.step_context import PREFILL, StepContext
    from engine.rank.step_metadata import build_step_metadata

    meta = build_step_metadata(batch.cu_seqlens_q, batch.context_lens, batch.block_tables,
                               batch.slot_mapping, worker.kv_head_of_q, worker.device,
                               uniform_groups=worker.uniform_groups)
    return StepContext(PREFILL, torch.tensor(batch.token_ids), torch.tensor(batch.positions),
                       None, worker.cache, meta, worker.backend.step_ops(decode=False))


def _logits(worker, ctx):
    """Every row's logits of the step `ctx`."""
    with torch.inference_mode():
        x, residual = worker.model(ctx)
    return worker.model.logits(x, residual, torch.arange(len(x)))


def _step_inputs(worker):
    """Step 2 of a chunked prefill: prompt A's last 8 tokens (12 cached in step 1, blocks 1-2),
    all 9 of prompt B (block 3) and one decode token of C at position 6 (block 4, cached 0-5)."""
    bs = worker.plan.block_size
    a, b, c = _ids(20, 301, 1), _ids(9, 301, 2), _ids(7, 301, 3)
    slots = lambda block, lo, hi: [block * bs + p for p in range(lo, hi)]  # noqa: E731

    def run(*step):
        _logits(worker, _context(worker, _batch(*step)))

    blocks_a = [1, 2] if bs < 20 else [1]
    block_of = lambda p: blocks_a[p // bs]  # noqa: E731
    run(a[:12], list(range(12)), [0, 12], [12], [blocks_a],
        [block_of(p) * bs + p % bs for p in range(12)])
    run(c[:6], list(range(6)), [0, 6], [6], [[4]], slots(4, 0, 6))
    ids = a[12:] + b + c[6:]
    positions = list(range(12, 20)) + list(range(9)) + [6]
    cu, lens, tables = [0, 8, 17, 18], [20, 9, 7], [blocks_a, [3], [4]]
    slot_mapping = [block_of(p) * bs + p % bs for p in range(12, 20)] + slots(3, 0, 9) \
        + slots(4, 6, 7)
    return ids, positions, cu, lens, tables, slot_mapping


def test_split_forward_matches_unsplit_at_every_split(worker):
    """One rank (no communication): only the split and its metadata are under test."""
    batch = _batch(*_step_inputs(worker))
    whole = _logits(worker, _context(worker, batch))
    # every split on torch; on the (slow) interpreter: in a prompt, on a boundary, the decode
    splits = range(1, batch.num_tokens) if worker.plan.backend == "torch" else (3, 8, 12, 17)
    for split in splits:
        ctx = with_halves(_context(worker, batch), batch, worker.kv_head_of_q,
                          worker.uniform_groups, split)
        got = _logits(worker, ctx)
        assert (got - whole).abs().max().item() <= 1e-5, f"split at row {split}"


def test_overlap_comm_setting_is_checked():
    with pytest.raises(ConfigError, match="overlap_comm='yes'"):
        LLM("unused", overlap_comm="yes")


def _run(llm: LLM, prompts: list[list[int]]) -> tuple[list[torch.Tensor], list[list[int]]]:
    pre = llm.prefill(prompts)
    gen = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    return [p.logits for p in pre], [g.token_ids for g in gen]


@pytest.mark.parametrize("tp", [2, 3])
def test_overlap_on_matches_off(ray_cluster, tiny_model_dir, tp):
    path = str(tiny_model_dir("uneven"))
    prompts = [_ids(n, 301, seed=s) for n, s in PROMPTS]
    # 32 tokens per step: the prompts are packed together and the long one is chunked
    settings = dict(tp=tp, max_num_batched_tokens=32, enable_prefix_caching=False)
    with LLM(path, **settings) as llm:
        ref_logits, ref_tokens = _run(llm, prompts)
    with LLM(path, overlap_comm=True, **settings) as llm:
        with llm.tracing() as records:
            logits, tokens = _run(llm, prompts)
        timings = llm.step_timings()
    assert tokens == ref_tokens
    for got, ref in zip(logits, ref_logits):
        assert (got - ref).abs().max().item() <= 1e-5
    # the split really ran: some QKV projection saw half of a 32-token step
    rows = {r["shapes"].split(",")[0] for r in records if r["name"] == "qkv_proj"}
    assert "[16" in rows, rows
    # the split layers' ops, the row-parallel linears and their all-reduces included, are traced
    # with their layer: each o_proj and down_proj has its own all-reduce in the same layer
    layers = range(llm.model_config.num_layers)
    in_layers = ("qkv_proj", "rope", "attention", "o_proj", "gate_up_proj", "down_proj")
    assert all(r["layer"] in layers for r in records if r["name"] in in_layers)
    for op in ("o_proj", "down_proj"):
        assert any(r["shapes"].startswith("[16") for r in records if r["name"] == op), op
    for layer in layers:
        count = lambda *names: sum(1 for r in records  # noqa: E731
                                   if r["name"] in names and r["layer"] == layer)
        assert count("all_reduce") == count("o_proj", "down_proj") > 0
    # every step reports its overlapped collectives: in flight at least as long as waited on
    assert all(t.comm_total_s >= t.comm_exposed_s - 1e-6 for t in timings)
    assert any(t.comm_total_s > 0 for t in timings)


def test_hydra_keys_reach_the_engine_settings():
    """parallel.overlap_comm and parallel.cp are Hydra keys, defaults off, checked like the rest."""
    from hydra import compose, initialize_config_dir

    from engine.config import EngineConfig
    from launcher.build_engine import CONF_DIR, engine_settings

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        defaults = engine_settings(compose("generate"))
        asked = engine_settings(compose("generate", overrides=["parallel.overlap_comm=true",
                                                               "parallel.cp=2"]))
    assert (defaults["overlap_comm"], defaults["cp"]) == (False, 1)
    assert (asked["overlap_comm"], asked["cp"]) == (True, 2)
    with pytest.raises(ConfigError, match="overlap_comm=True with cp=2"):
        EngineConfig.from_kwargs(**{**asked, "enable_prefix_caching": False})
