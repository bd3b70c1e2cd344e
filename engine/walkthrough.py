"""A measured walk through one prefill and one decode step of the engine itself.

Every op of the forward, on every rank, is recorded by the rank's tracer during a real request:
its shapes, FLOPs (a multiply-add is 2), bytes read and written, and time. The report adds what
follows from them against the hardware's roofline, what the KV cache holds, the first token's
candidates, what the cache saves over recomputation, and where the TTFT went.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.costs import forward_flops
from engine.hardware import Hardware
from engine.sampling_params import SamplingParams


def _op_dict(rec: dict, hw: Hardware) -> dict:
    t, flops, nbytes = rec["time_s"], rec["flops"], rec["bytes"]
    return {**rec,
            "intensity": flops / nbytes if nbytes else float("inf"),
            "achieved_flops_per_s": flops / t if t > 0 else 0.0,
            "achieved_bytes_per_s": nbytes / t if t > 0 else 0.0,
            "bound": hw.bound(flops, nbytes)}


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

    def by_op(self) -> list[dict]:
        """Each op name summed over layers and ranks, in forward order."""
        rows: dict[str, dict] = {}
        for op in self.ops:
            row = rows.setdefault(op["name"], {"name": op["name"], "shapes": op["shapes"],
                                               "count": 0, "flops": 0, "bytes": 0, "time_s": 0.0})
            row["count"] += 1
            row["flops"] += op["flops"]
            row["bytes"] += op["bytes"]
            row["time_s"] += op["time_s"]
        return list(rows.values())

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
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"prompt": self.prompt, "model": self.model, "hardware": self.hardware.to_dict(),
                "prefill": self.prefill.to_dict(), "decode": self.decode.to_dict(),
                "kv_cache": self.kv_cache, "first_token": self.first_token,
                "cache_savings": self.cache_savings, "ttft": self.ttft}

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
