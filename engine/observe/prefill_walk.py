"""A measured walk through one prefill and one decode step of the engine itself.

Every op of the forward, on every rank, is recorded by the rank's tracer during a real request:
its shapes, FLOPs (a multiply-add is 2), bytes read and written, and time. The report adds what
follows from them against the hardware's roofline, what the KV cache holds, the first token's
candidates, what the cache saves over recomputation, and where the TTFT went.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.observe.costs import forward_flops
from engine.observe.hardware import Hardware
from engine.driver.sampling_params import SamplingParams


def _op_dict(rec: dict, hw: Hardware) -> dict:
    t, flops, nbytes = rec["time_s"], rec["flops"], rec["bytes"]
    return {**rec,
            "intensity": flops / nbytes if nbytes else float("inf"),
            "achieved_flops_per_s": flops / t if t > 0 else 0.0,
            "achieved_bytes_per_s": nbytes / t if t > 0 else 0.0,
            "bound": hw.bound(flops, nbytes)}


def ops_by_name(ops: list[dict]) -> list[dict]:
    """Each op name summed over layers and ranks, in forward order."""
    rows: dict[str, dict] = {}
    for op in ops:
        row = rows.setdefault(op["name"], {"name": op["name"], "shapes": op["shapes"],
                                           "count": 0, "flops": 0, "bytes": 0, "time_s": 0.0})
        row["count"] += 1
        for key in ("flops", "bytes", "time_s"):
            row[key] += op[key]
    return list(rows.values())


@dataclass(slots=True)
class Section:
    """One forward pass (the prefill, or one decode step) over all ranks."""

    tokens: int
    ops: list[dict]
    wall_s: float

    @classmethod
    def from_records(cls, records: list[dict], tokens: int, wall_s: float, hw: Hardware) -> "Section":
        return cls(tokens, [_op_dict(r, hw) for r in records], wall_s)

    @property
    def total_flops(self) -> int:
        return sum(op["flops"] for op in self.ops)

    @property
    def total_bytes(self) -> int:
        return sum(op["bytes"] for op in self.ops)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "wall_s": self.wall_s, "total_flops": self.total_flops,
                "total_bytes": self.total_bytes,
                "intensity": self.total_flops / self.total_bytes if self.total_bytes else 0.0,
                "ops": self.ops}


@dataclass(slots=True)
class WalkthroughReport:
    prompt: dict
    model: dict
    hardware: Hardware
    prefill: Section
    decode: Section
    kv_cache: dict
    first_token: dict
    cache_savings: dict
    ttft: dict
    comm: dict  # per phase: rank 0's collectives exposed (waited on) and in flight in all

    def to_dict(self) -> dict:
        return {"prompt": self.prompt, "model": self.model, "hardware": self.hardware.to_dict(),
                "prefill": self.prefill.to_dict(), "decode": self.decode.to_dict(),
                "kv_cache": self.kv_cache, "first_token": self.first_token,
                "cache_savings": self.cache_savings, "ttft": self.ttft, "comm": self.comm}

    def chrome_trace(self) -> dict:
        """Chrome/Perfetto trace events: one process per phase, one thread (timeline) per rank."""
        events = []
        for pid, section in ((0, self.prefill), (1, self.decode)):
            events.append({"ph": "M", "name": "process_name", "pid": pid,
                           "args": {"name": "prefill" if pid == 0 else "decode step"}})
            for op in section.ops:
                events.append({"ph": "X", "pid": pid, "tid": op["rank"],
                               "name": op["name"] if op["layer"] < 0 else f"L{op['layer']} {op['name']}",
                               "ts": op["start_s"] * 1e6, "dur": op["time_s"] * 1e6,
                               "args": {k: op[k] for k in ("shapes", "flops", "bytes", "bound")}})
            for rank in sorted({op["rank"] for op in section.ops}):
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": rank,
                               "args": {"name": f"rank {rank}"}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}


def _traced(llm, fn) -> tuple[list[dict], object]:
    """Run fn() with every rank tracing; all ranks' records, and fn's result."""
    with llm.tracing() as records:
        result = fn()
    return records, result


def _last_step(records: list[dict]) -> list[dict]:
    """The records of the final forward pass: each pass starts with the embedding on every rank."""
    by_rank: dict[int, list[dict]] = {}
    for rec in records:
        by_rank.setdefault(rec["rank"], []).append(rec)
    last = []
    for recs in by_rank.values():
        starts = [i for i, r in enumerate(recs) if r["name"] == "embedding"]
        last += recs[starts[-1]:] if starts else []
    return last


def _model_section(llm) -> dict:
    mc, cfg = llm.model_config, llm.config
    ranks = [{k: getattr(info, k) for k in ("rank", "q_heads", "kv_heads", "ffn", "vocab",
                                            "weight_bytes", "kernels")} for info in llm.rank_info()]
    return {"name": cfg.model, "layers": mc.num_layers, "hidden": mc.hidden_size,
            "heads": mc.num_heads, "kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim,
            "ffn": mc.intermediate_size, "vocab": mc.vocab_size, "params": mc.num_params,
            "dtype": str(cfg.torch_dtype).replace("torch.", ""), "tp": cfg.tp, "cp": cfg.cp,
            "ranks": ranks}


def _kv_section(llm, out) -> dict:
    mc, tokens = llm.model_config, len(out.prompt_token_ids)
    ranks = []
    for info in llm.rank_info():
        heads = info.kv_heads[1] - info.kv_heads[0]
        ranks.append({"rank": info.rank, "kv_heads": info.kv_heads,
                      "bytes_per_token": info.kv_bytes_per_token,
                      "bytes_held": tokens * info.kv_bytes_per_token,
                      "cache_shape": f"[2, {mc.num_layers}, {info.num_blocks}, "
                                     f"{llm.config.block_size}, {heads}, {mc.head_dim}]"})
    return {"tokens": tokens, "block_table": out.block_table, "block_size": llm.config.block_size,
            "bytes_total": sum(r["bytes_held"] for r in ranks), "ranks": ranks}


def _first_token(llm, out, top_k: int) -> dict:
    probs = out.logits.softmax(-1)
    top = torch.topk(probs, top_k)
    piece = llm.tokenizer.piece if llm.tokenizer else str
    return {"id": out.first_token, "text": piece(out.first_token),
            "candidates": [{"id": int(i), "text": piece(int(i)), "prob": float(p)}
                           for p, i in zip(top.values, top.indices)]}


def _cache_savings(llm, ids: list[int], n: int) -> dict:
    """Generate n tokens with the cache, and again recomputing the whole sequence each step."""
    mc = llm.model_config
    # both sides prefill the whole prompt: the runs before this one left it in the prefix cache
    with llm.prefix_caching(False):
        start = time.perf_counter()
        [g] = llm.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))
        with_cache = time.perf_counter() - start
        seq, start = list(ids), time.perf_counter()
        for token in g.token_ids:
            llm.prefill([seq])
            seq.append(token)
    recompute = time.perf_counter() - start
    t = len(ids)
    flops_cache = forward_flops(mc, t, t) + sum(forward_flops(mc, 1, t + i) for i in range(1, n))
    flops_recompute = sum(forward_flops(mc, t + i, t + i) for i in range(n))
    return {"tokens": n, "flops_with_cache": flops_cache, "flops_recompute": flops_recompute,
            "time_with_cache_s": with_cache, "time_recompute_s": recompute}


def _ttft_parts(tokenize_s: float, step, prefill: Section, ttft_s: float) -> dict:
    ops = prefill.ops
    rank0 = [op for op in ops if op["rank"] == 0]
    collectives = sum(op["time_s"] for op in rank0 if op["name"] in ("all_reduce", "gather_logits"))
    lm_head = sum(op["time_s"] for op in rank0 if op["name"] in ("final_norm", "lm_head"))
    parts = {"tokenization": tokenize_s, "scheduling": step.schedule_s,
             "driver -> ranks -> driver": step.transfer_s,
             "forward (layers)": step.forward_s - collectives - lm_head,
             "collectives": collectives, "final norm + LM head": lm_head, "sampling": step.sample_s}
    return {"total_s": tokenize_s + ttft_s, "parts": parts}


def _comm(step) -> dict:
    """Rank 0's communication in one step: `exposed_s` it spent blocked on collectives,
    `total_s` they were in flight (more than exposed only when overlap_comm hides some)."""
    return {"exposed_s": step.comm_exposed_s, "total_s": step.comm_total_s}


def run_walkthrough(llm, prompt, hw: Hardware, decode_tokens: int = 8, top_k: int = 5) -> WalkthroughReport:
    """Prefill `prompt` once with tracing on, then one traced decode step, then the comparisons."""
    start = time.perf_counter()
    ids = llm.tokenize(prompt if isinstance(prompt, str) else list(prompt))  # e.g. a Hydra list
    tokenize_s = time.perf_counter() - start
    llm.prefill([ids[:1]])  # warm-up: first-call costs are not the prefill's
    with llm.prefix_caching(False):  # a full prefill, whatever was cached
        records, [out] = _traced(llm, lambda: llm.prefill([ids]))
    step = llm.step_timings()[-1]
    prefill = Section.from_records(records, len(ids), step.forward_s + step.sample_s, hw)
    records, _ = _traced(llm, lambda: llm.generate([ids], SamplingParams(max_tokens=2, ignore_eos=True)))
    decode_step = llm.step_timings()[-1]
    decode = Section.from_records(_last_step(records), 1, decode_step.forward_s + decode_step.sample_s, hw)
    pieces = [llm.tokenizer.piece(t) for t in ids] if llm.tokenizer else [str(t) for t in ids]
    return WalkthroughReport(
        prompt={"text": prompt if isinstance(prompt, str) else None, "token_ids": ids, "pieces": pieces},
        model=_model_section(llm), hardware=hw, prefill=prefill, decode=decode,
        kv_cache=_kv_section(llm, out), first_token=_first_token(llm, out, top_k),
        cache_savings=_cache_savings(llm, ids, decode_tokens),
        ttft=_ttft_parts(tokenize_s, step, prefill, out.ttft_s),
        comm={"prefill": _comm(step), "decode": _comm(decode_step)})
