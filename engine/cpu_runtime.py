"""Which OpenMP and malloc a CPU engine's process runs on: torch's own (GNU's libgomp, glibc's
malloc), or Intel's OpenMP (the `intel-openmp` wheel scripts/setup.sh installs) and tcmalloc
(where the system has it) preloaded, whichever ran a layer's ops faster on this machine.

Why: a layer is ~10 OpenMP regions (projections, attention, the small ops) with Python between
them, and every region must wake the other threads, and a prompt's temporaries go through the
allocator (vLLM's CPU guide runs it preloaded so too). `python -m bench.peers`'s `engine` and
`engine-gnu` rows compare the two (BENCHMARKS.md, session 55).

A library can only be preloaded when a process starts, so the engine's launchers (every Hydra
app, `prefill`, bench.peers's engine rows) call `relaunch_preloaded()` first, before torch is
imported (this module imports none): where preloading won here it starts the same command
again with LD_PRELOAD set. Which won is measured once per
machine (`python -m engine.cpu_runtime` prints it): a probe of a layer's ops at prompt sizes,
bf16 and float32, in child processes each way, alternating; kept under the cache folder, and
probed again once a week (~14 s of one start on the Zen 5 EPYC), each way keeping its better
time.
PREFILL_ENGINE_CPU_RUNTIME=intel or =gnu decides without measuring.
"""
from __future__ import annotations

import ctypes.util
import importlib.metadata
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from engine.errors import ConfigError
from engine.machine import (cache_dir, cpu_description, measured_long_ago, read_whole,
                            write_whole)

if TYPE_CHECKING:
    import torch

log = logging.getLogger("engine")

CHOICE_ENV = "PREFILL_ENGINE_CPU_RUNTIME"  # "intel" | "gnu": decided, not measured
# set in a relaunched process, to the LD_PRELOAD it had before (its children get that back)
RELAUNCHED_ENV = "PREFILL_ENGINE_RELAUNCHED"
CHOICES = ("intel", "gnu")
# preloading must win by more than this (the probe's own noise is a few %)
MARGIN = 1.03
PROBE_ROUNDS = 2  # child processes each way, alternating
PROBE_TIMEOUT_S = 300


def intel_libraries() -> list[str]:
    """What preloading means here: Intel's OpenMP from this environment, and tcmalloc where the
    system has it ([] without Intel's OpenMP: tcmalloc alone is not offered)."""
    openmp = Path(sys.prefix) / "lib" / "libiomp5.so"  # where the intel-openmp wheel puts it
    if not openmp.is_file():
        return []
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    return [p for p in (tcmalloc, str(openmp)) if p]


def loaded() -> list[str]:
    """Of intel_libraries(), those this process has loaded (by file name)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return [lib for lib in intel_libraries() if Path(lib).name in maps]


def openmp() -> str:
    """Which OpenMP this process runs: "intel" (preloaded) or "gnu" (torch's own)."""
    return "intel" if any(Path(lib).name.startswith("libiomp5") for lib in loaded()) else "gnu"


def describe() -> str:
    """Which OpenMP and malloc this process runs, for a report."""
    if openmp() == "gnu":
        return "torch's own: GNU OpenMP, the C library's malloc"
    return "Intel's OpenMP" + (", tcmalloc" if len(loaded()) > 1 else "") + " (preloaded)"


def preloaded_env() -> dict[str, str]:
    """This process's environment with intel_libraries() first in LD_PRELOAD."""
    env = dict(os.environ)
    libraries = intel_libraries()
    if libraries:
        env["LD_PRELOAD"] = ":".join([*libraries, *filter(None, [env.get("LD_PRELOAD")])])
        # tcmalloc reports every allocation over 1 GB (a large model's KV cache) on stderr
        env.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40))
    return env


def choice() -> str:
    """"intel" or "gnu" for this machine: as the environment says, else as measured (once per
    machine, libraries and torch, and again once a week: engine.machine.REMEASURE_AFTER;
    kept)."""
    asked = os.environ.get(CHOICE_ENV)
    if asked is not None:
        if asked not in CHOICES:
            raise ConfigError(f"{CHOICE_ENV}={asked!r}: use one of {CHOICES}, or unset it to "
                              f"measure")
        return asked
    libraries = intel_libraries()
    if not libraries:
        return "gnu"
    path = cache_dir() / "cpu_runtime.json"
    kept = read_whole(path)
    key = _key(libraries)
    earlier = kept.get(key) if isinstance(kept.get(key), dict) else {}
    if earlier.get("choice") not in CHOICES or measured_long_ago(earlier.get("timed")):
        try:
            kept[key] = _better_of(measure(), earlier)
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            # kept too: a later start does not probe (and fail) again, until it is out of date
            log.warning("could not measure the CPU runtimes (%s); keeping torch's own", e)
            kept[key] = {"choice": "gnu", "error": str(e)[-300:]}
        kept[key]["timed"] = time.time()
        write_whole(path, kept)
    return kept[key]["choice"]


def _better_of(measured: dict, earlier: dict) -> dict:
    """`measured`, each way keeping the better of its new and `earlier` probe times (a probe
    slowed by something else running is only ever slower), and the choice they then make."""
    best = {}
    for name in CHOICES:
        times = (measured[f"{name}_s"], earlier.get(f"{name}_s"))
        best[name] = min(t for t in times if isinstance(t, (int, float)) and t > 0)
    return _decided(best["intel"], best["gnu"])


def _decided(intel_s: float, gnu_s: float) -> dict:
    return {"choice": "intel" if intel_s * MARGIN < gnu_s else "gnu",
            "intel_s": intel_s, "gnu_s": gnu_s}


def relaunch_preloaded() -> None:
    """Start this command again with Intel's OpenMP and tcmalloc preloaded, where they won on
    this machine and are not loaded yet; else return. Call it before anything else runs.
    In the relaunched process the environment is put back as it was, so the processes it
    starts (Ray's, a subprocess) do not inherit the preload."""
    before = os.environ.pop(RELAUNCHED_ENV, None)
    if before is not None:
        if before:
            os.environ["LD_PRELOAD"] = before
        else:
            os.environ.pop("LD_PRELOAD", None)
        return
    if loaded():
        return
    try:
        use = choice() == "intel"
    except ConfigError as e:  # as a launcher reports a bad setting: one line, exit code 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if use and not intel_libraries():
        log.warning("%s=intel, but this environment has no Intel OpenMP (pip install "
                    "intel-openmp); keeping torch's own", CHOICE_ENV)
    elif use:
        env = preloaded_env()
        env[RELAUNCHED_ENV] = os.environ.get("LD_PRELOAD", "")
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def measure() -> dict:
    """{"choice", "intel_s", "gnu_s"}: the probe's best seconds each way, in alternating child
    processes."""
    seconds: dict[str, list[float]] = {name: [] for name in CHOICES}
    for _ in range(PROBE_ROUNDS):
        for name in CHOICES:
            env = preloaded_env() if name == "intel" else dict(os.environ)
            done = subprocess.run([sys.executable, "-m", "engine.cpu_runtime", "--probe"],
                                  env=env, capture_output=True, text=True,
                                  timeout=PROBE_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(f"the {name} probe failed: {done.stderr.strip()[-300:]}")
            try:
                seconds[name].append(float(done.stdout.split()[-1]))
            except (IndexError, ValueError):  # a library's own line last, or nothing
                raise RuntimeError(f"the {name} probe printed no time: "
                                   f"{done.stdout.strip()[-300:]!r}") from None
    return _decided(min(seconds["intel"]), min(seconds["gnu"]))


def _key(libraries: list[str]) -> str:
    versions = []
    for package in ("torch", "intel-openmp"):
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package} absent")
    return "|".join([cpu_description(), f"{os.cpu_count()} cpus", *versions, *libraries])


def probe_seconds(rows: int = 512, layers: int = 4, repeats: int = 5) -> float:
    """The best time of `layers` layers' prompt ops (SmolLM2's shapes: the projections, the
    small ops, attention) run as an eager step runs them, bf16's plus float32's."""
    import torch

    total = 0.0
    for dtype in (torch.bfloat16, torch.float32):
        layer = _probe_layer(rows, dtype)
        x, residual = torch.randn(rows, 576, dtype=dtype), torch.zeros(rows, 576, dtype=dtype)
        best = float("inf")
        with torch.inference_mode():
            for _ in range(repeats + 1):  # the first warms up
                start = time.perf_counter()
                y, r = x, residual
                for _ in range(layers):
                    y, r = layer(y, r)
                best = min(best, time.perf_counter() - start)
        total += best
    return total


def _probe_layer(rows: int, dtype: torch.dtype) -> Callable:
    """(x, residual) -> (x, residual) through a random SmolLM2-shaped layer of `dtype`."""
    import torch
    import torch.nn.functional as F

    from engine.rank import gemm
    from engine.rank.backend import cpu_torch

    ops = cpu_torch()  # the small ops as the engine runs them here
    d, ffn, heads, kv_heads, hd = 576, 1536, 9, 3, 64
    torch.manual_seed(0)
    w = {name: torch.randn(*shape, dtype=dtype) / shape[-1] ** 0.5 for name, shape in (
        ("qkv", ((heads + 2 * kv_heads) * hd, d)), ("o", (d, heads * hd)),
        ("gate_up", (2 * ffn, d)), ("down", (d, ffn)), ("norm", (d,)))}
    angles = torch.outer(torch.arange(rows, dtype=torch.float32), torch.rand(hd // 2))
    positions, cos, sin = torch.arange(rows), angles.cos(), angles.sin()

    def heads_first(t: torch.Tensor, n: int) -> torch.Tensor:
        return t.reshape(rows, n, hd).transpose(0, 1)

    def layer(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = ops.rmsnorm(x, residual, w["norm"], 1e-5)
        q, k, v = gemm.linear(h, w["qkv"], None).split(
            [heads * hd, kv_heads * hd, kv_heads * hd], -1)
        q, k = ops.rope(positions, q.view(rows, heads, hd), k.view(rows, kv_heads, hd), cos, sin)
        out = F.scaled_dot_product_attention(
            heads_first(q, heads), heads_first(k, kv_heads), heads_first(v, kv_heads),
            is_causal=True, enable_gqa=True).transpose(0, 1).flatten(1)
        h, residual = ops.rmsnorm(gemm.linear(out, w["o"], None), residual, w["norm"], 1e-5)
        gated = ops.silu_mul(gemm.linear(h, w["gate_up"], None))
        return gemm.linear(gated, w["down"], None), residual
    return layer


if __name__ == "__main__":
    if sys.argv[1:] == ["--probe"]:
        print(probe_seconds())
    else:
        chosen = choice()  # measured first where nothing (or nothing recent) is kept
        kept = read_whole(cache_dir() / "cpu_runtime.json").get(_key(intel_libraries()))
        print(f"{chosen}: {kept} (loaded here: {loaded() or 'none'})")
