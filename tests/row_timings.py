"""Quantized weights' start-up timings of their few-row products (engine.rank.kernel_choice:
torch's kernel against the C++ one, engine.rank.quantized_rows) made certain, for tests that
need the C++ kernels picked, or not, whatever this machine would time."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from engine.rank import kernel_choice as kc
from tests.engine_cache import fresh_cache


def fused_wins(weight) -> dict[str, float]:
    """The C++ kernel 3x as fast as torch's for every weight."""
    return {"torch": 3e-3, "fused": 1e-3}


def certain_row_timings(monkeypatch, cache: Path | str,
                        seconds: Callable[[object], dict[str, float]] = fused_wins) -> None:
    """Every quantized row product's timing is `seconds(weight)` ({"torch": s, "fused": s}),
    kept under `cache` (a test's own, so no kept timing of another run is read); other kernels'
    timings stay real."""
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(fresh_cache(Path(cache))))
    timed = kc._time_linear
    monkeypatch.setattr(kc, "_time_linear", lambda kernels, weight, rows, prepare=None: (
        seconds(weight) if set(kernels) == {"torch", "fused"}
        else timed(kernels, weight, rows, prepare)))
