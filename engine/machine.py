"""The machine the engine runs on, and where it keeps what it measured there (kernel timings,
compiled code and graphs, built C++ kernels, the CPU runtime's choice): shared by
engine.rank.kernel_choice and engine.cpu_runtime, and needing no torch itself."""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

# the vector extensions a kept measurement depends on
KEY_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_description() -> str:
    """The CPU's model name and which of KEY_FLAGS it has: `model|flag,flag`."""
    model, flags = platform.processor(), ""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        model = next((l.split(":", 1)[1].strip() for l in lines if l.startswith("model name")),
                     model)
        present = set(next((l.split(":", 1)[1].split() for l in lines if l.startswith("flags")),
                           []))
        flags = ",".join(f for f in KEY_FLAGS if f in present)
    except OSError:
        pass
    return f"{model}|{flags}"


# A kept measurement (kernel timings, the CPU runtime's probe) is taken again after this long,
# each candidate keeping the better of its kept and new times: one taken while something else
# ran (which only ever makes it slower) would otherwise decide for every later start on the
# machine; the best of several converges on the machine's own speed. Rare enough that nearly
# every start reads what was kept: a new measurement costs seconds of one start.
REMEASURE_AFTER = 7 * 24 * 3600.0


def measured_long_ago(timed: object) -> bool:
    """Whether a measurement kept with `timed` (time.time() when taken) is to be taken again:
    over REMEASURE_AFTER old, stamped later than now (a clock set back), or not stamped."""
    return not (isinstance(timed, (int, float))
                and 0 <= time.time() - timed <= REMEASURE_AFTER)


def cache_dir() -> Path:
    return Path(os.environ.get("PREFILL_ENGINE_CACHE")
                or Path.home() / ".cache" / "prefill-engine")


def read_whole(path: Path) -> dict:
    """What `write_whole` kept at `path`; {} where nothing readable is."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def write_whole(path: Path, entries: dict) -> None:
    """`entries` as JSON at `path`, through a rename, so a reader never sees half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=0, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the choice holds for this run, it is just not kept
