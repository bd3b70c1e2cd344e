"""Which ops an engine's steps called, in order, with their inputs' shapes: torch's profiler
on the engine's step thread (it records the thread it starts on), around `run`."""
from __future__ import annotations

from typing import Callable

import torch


def op_calls(llm, run: Callable[[], object], names: set[str]) -> tuple[object, list]:
    """run()'s result and its steps' calls of the ops in `names`: (name, input shapes)."""
    profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                     record_shapes=True)
    llm._core.call(profile.__enter__)
    try:
        result = run()
    finally:
        llm._core.call(lambda: profile.__exit__(None, None, None))
    events = sorted((e for e in profile.events() if e.name in names),
                    key=lambda e: e.time_range.start)
    return result, [(e.name, e.input_shapes) for e in events]
