"""Build a CUDA rank and step it under fake CUDA (tests/fake_cuda.py); print what it recorded.

    python -m tests.fake_cuda_run MODEL_DIR CACHE_DIR   # one JSON object on the last line

Runs in a process of its own, without TRITON_INTERPRET (the GPU's kernels and tile sizes), for
each scenario: the torch and the Triton backend, at TP=1 and at rank 0 and rank 1 of TP=2's
shapes (no process group: the collectives of a world of one), each building the plan (KV cache
sized from the fake GPU's free memory) and a `Worker` on `cuda`, then running two prompt steps
and two decode steps of lengths the warm-up did not run. `tests/test_fake_cuda.py` reads it.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from engine.batch import Batch, SamplingSpec
from tests.fake_cuda import GIB, FakeGpu, Recorder, fake_cuda

BLOCK = 16
FREE_BYTES = GIB  # what the fake GPU reports free: sizes the KV cache
SCENARIOS = [("torch", 1, 0), ("torch", 2, 0), ("torch", 2, 1),
             ("triton", 1, 0), ("triton", 2, 0)]
# (name, tokens per sequence, start position, sequences): lengths the warm-up never ran
STEPS = [("prefill", 37, 0, 2), ("prefill", 100, 0, 1), ("decode", 1, 37, 2),
         ("decode", 1, 140, 3), ("decode", 1, 5, 1)]


def make_batch(num_tokens: int, start: int, num_seqs: int) -> Batch:
    """`num_seqs` sequences of `num_tokens` new tokens after `start` cached ones, each in its own
    blocks (block ids 1..), logits at each sequence's last token."""
    per_seq = -(-(start + num_tokens) // BLOCK)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(num_seqs)]
    positions = list(range(start, start + num_tokens)) * num_seqs
    slots = [tables[i][p // BLOCK] * BLOCK + p % BLOCK
             for i in range(num_seqs) for p in range(start, start + num_tokens)]
    return Batch([7] * len(positions), positions, list(range(0, len(positions) + 1, num_tokens)),
                 [start + num_tokens] * num_seqs, slots, tables,
                 list(range(num_tokens - 1, len(positions), num_tokens)),
                 [SamplingSpec()] * num_seqs)


def _events(rec: Recorder, mark: int) -> dict:
    """What one stretch of work cost the (fake) GPU."""
    ev = rec.since(mark)
    return {
        "h2d": [e.detail for e in ev if e.kind == "h2d"],
        "d2h": len([e for e in ev if e.kind == "d2h"]),
        "syncs": [{"where": e.where, "stack": e.detail["stack"]} for e in ev if e.kind == "sync"],
        "cuda_calls": [e.kind for e in ev if e.kind.startswith("cuda:")],
        "launches": [{"kernel": e.detail["kernel"], "devices": e.detail["devices"],
                      "specialization": list(e.detail["specialization"]),
                      "where": e.where} for e in ev if e.kind == "launch"],
        "autotune_benches": [e.detail for e in ev if e.kind == "autotune-bench"],
    }


def run_scenario(model_dir: str, rec: Recorder, backend: str, tp: int, rank: int) -> dict:
    from engine.config import EngineConfig
    from engine.loading.checkpoint import open_checkpoint
    from engine.plan import make_plan
    from engine.rank.worker import Worker

    cfg = EngineConfig.from_kwargs(model=model_dir, device="cuda", tp=tp, compile=False,
                                   attention_backend=backend, block_size=BLOCK,
                                   max_model_len=256)
    ckpt = open_checkpoint(model_dir)
    mark = rec.mark()
    plan = make_plan(cfg, model_dir, ckpt.config)
    worker = Worker(plan, rank=rank, world_size=tp, checkpoint=ckpt)
    out = {"build": _events(rec, mark), "num_blocks": plan.num_blocks,
           "weight_bytes_per_rank": sum(p.numel() * p.element_size()
                                        for p in worker.model.parameters()),
           "set_device": [e.detail["index"] for e in rec.since(mark, "cuda:set_device")],
           "devices": sorted({str(t.device) for t in [*worker.model.parameters(),
                                                      *worker.model.buffers(),
                                                      worker.cache.data]}),
           "cache_shape": list(worker.cache.data.shape), "steps": []}
    for name, num_tokens, start, num_seqs in STEPS:
        mark = rec.mark()
        result = worker.execute(make_batch(num_tokens, start, num_seqs))
        step = _events(rec, mark)
        step.update(name=name, num_tokens=num_tokens * num_seqs, num_seqs=num_seqs,
                    tokens=None if result is None else result.token_ids,
                    comm_exposed_s=None if result is None else result.collective_s,
                    comm_total_s=None if result is None else result.comm_total_s)
        out["steps"].append(step)
    mark = rec.mark()
    worker.release_memory()  # as the engine's shutdown does
    out["release"] = {"cache_shape": list(worker.cache.data.shape),
                      "cuda_calls": _events(rec, mark)["cuda_calls"]}
    return out


GRAPH_STEPS = [(37, 2), (140, 3), (5, 1), (37, 9)]  # (context before, sequences): decode steps


def run_cuda_graphs(model_dir: str, rec: Recorder) -> dict:
    """A compiled rank's decode CUDA graphs: captured for every bucket and width, then decode
    steps through CompiledModel.decode_context and decode_logits. Its decode function runs as its eager self here
    (compiling for CUDA needs a GPU); everything around it is the engine's own."""
    from engine.config import EngineConfig
    from engine.loading.checkpoint import open_checkpoint
    from engine.plan import make_plan
    from engine.rank import compiled as compiled_mod
    from engine.rank.worker import Worker

    cfg = EngineConfig.from_kwargs(model=model_dir, device="cuda", compile=False,
                                   attention_backend="torch", block_size=BLOCK,
                                   max_model_len=256)
    ckpt = open_checkpoint(model_dir)
    worker = Worker(make_plan(cfg, model_dir, ckpt.config), checkpoint=ckpt)
    model = compiled_mod.CompiledModel(worker.model)
    # the graphs' functions, uncompiled
    model._decode_layer = dict.fromkeys(compiled_mod.DECODE_BUCKETS, compiled_mod._layer)
    model._decode_head = dict.fromkeys(compiled_mod.DECODE_BUCKETS, compiled_mod._decode_head)
    mark = rec.mark()
    model.capture_decode_graphs(worker.cache, worker.kv_head_of_q_device, 256, False)
    graphs = model.cuda_graphs
    out = {"capture": {**_events(rec, mark), "events": [e.kind for e in rec.since(mark)]},
           "captured": sorted(graphs.graphs), "usable": graphs.usable,
           "input_buffers": {f"{r}x{w}": id(c.inputs) for (r, w), c in graphs.graphs.items()},
           "replays": []}
    for start, seqs in GRAPH_STEPS:
        batch = make_batch(1, start, seqs)
        rows = model.decode_bucket(seqs)  # None: more rows than any graph, an eager step
        mark = rec.mark()
        logits = (model.decode_logits(model.decode_context(batch, worker.cache,
                                                           worker.kv_head_of_q_device, rows,
                                                           False))
                  if rows is not None else None)
        step = _events(rec, mark)
        step.update(seqs=seqs, context=start + 1, rows=rows,
                    logits_shape=None if logits is None else list(logits.shape),
                    graph_replays=len(rec.since(mark, "cuda:graph.replay")),
                    into=[e.detail.get("into") for e in rec.since(mark, "h2d")])
        out["replays"].append(step)
    graphs.usable = False  # as after a failed capture: every step runs the uncaptured graph
    mark = rec.mark()
    logits = model.decode_logits(model.decode_context(make_batch(1, 37, 2), worker.cache,
                                                      worker.kv_head_of_q_device, 2, False))
    out["uncaptured"] = {"graph_replays": len(rec.since(mark, "cuda:graph.replay")),
                         "logits_shape": list(logits.shape), **_events(rec, mark)}
    return out


def run_compiled(model_dir: str, rec: Recorder, cache_dir: Path) -> dict:
    """compile=True on one GPU, from start-up to steps: the warm-up, the decode CUDA graphs'
    capture, then the prompt's graphs timed against eager, all by the engine's own code but
    the compiler: torch.compile hands each function back as it is (compiling for CUDA needs a
    GPU). The timing is a stand-in in which eager wins, so the steps after it show the pick
    at work."""
    from unittest import mock

    from engine.config import EngineConfig
    from engine.loading.checkpoint import open_checkpoint
    from engine.plan import make_plan
    from engine.rank import kernel_choice
    from engine.rank.worker import Worker

    timed = []

    def eager_wins(kind: str, candidates: dict, rounds: int) -> dict[str, float]:
        timed.append({"kind": kind, "candidates": sorted(candidates)})
        return {"graph": 2.0, "eager": 1.0}

    cfg = EngineConfig.from_kwargs(model=model_dir, device="cuda", compile=True,
                                   attention_backend="torch", block_size=BLOCK,
                                   max_model_len=256)
    ckpt = open_checkpoint(model_dir)
    with mock.patch.object(torch, "compile", lambda fn, **options: fn), \
            mock.patch.object(kernel_choice, "_time_step", eager_wins), \
            mock.patch.dict(os.environ, {"PREFILL_ENGINE_CACHE": str(cache_dir / "engine")}):
        plan = make_plan(cfg, model_dir, ckpt.config)
        worker = Worker(plan, checkpoint=ckpt)
        kept = kernel_choice.read_whole(cache_dir / "engine" / "kernel_timings.json")
    out = {"time_graph_steps": plan.time_graph_steps, "timed": timed,
           "graph_steps": dict(worker.compiled.graph_steps),
           "picks": worker.kernels.describe(), "kept_keys": sorted(kept),
           "captured": sorted(worker.compiled.cuda_graphs.graphs), "steps": []}
    for name, num_tokens, start, num_seqs in STEPS:
        mark = rec.mark()
        result = worker.execute(make_batch(num_tokens, start, num_seqs))
        out["steps"].append({"name": name, "graph": result.graph,
                             "syncs": len(_events(rec, mark)["syncs"]),
                             "graph_replays": len(rec.since(mark, "cuda:graph.replay"))})
    worker.release_memory()
    return out


def _process_group(tp: int, rank: int):
    """TP=2's collectives go through torch.distributed's own "fake" backend (no peer: every
    collective returns at once), so the NCCL-side code runs on device tensors; TP=1: none."""
    import contextlib

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if tp == 1:
        return contextlib.nullcontext()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=tp)
    return contextlib.closing(SimpleNamespace(close=dist.destroy_process_group))


def main(model_dir: str, cache_dir: str) -> None:
    assert "TRITON_INTERPRET" not in os.environ, "run the GPU's kernels, not the interpreter"
    results = {}
    for backend, tp, rank in SCENARIOS:
        with _process_group(tp, rank), fake_cuda(Path(cache_dir),
                                                 FakeGpu(free_bytes=FREE_BYTES)) as rec:
            try:
                results[f"{backend}-tp{tp}-rank{rank}"] = run_scenario(model_dir, rec, backend,
                                                                       tp, rank)
            except Exception as e:  # noqa: BLE001  reported to the test, which shows it
                import traceback

                results[f"{backend}-tp{tp}-rank{rank}"] = {
                    "error": f"{type(e).__name__}: {e}"[:2000],
                    "traceback": traceback.format_exc()[-6000:]}
    with fake_cuda(Path(cache_dir), FakeGpu(free_bytes=FREE_BYTES)) as rec:
        results["cuda-graphs"] = run_cuda_graphs(model_dir, rec)
    with fake_cuda(Path(cache_dir), FakeGpu(free_bytes=FREE_BYTES)) as rec:
        try:
            results["compiled"] = run_compiled(model_dir, rec, Path(cache_dir))
        except Exception as e:  # noqa: BLE001
            import traceback

            results["compiled"] = {"error": f"{type(e).__name__}: {e}"[:2000],
                                   "traceback": traceback.format_exc()[-6000:]}
    print(json.dumps(results))


if __name__ == "__main__":
    torch.manual_seed(0)
    main(*sys.argv[1:3])
