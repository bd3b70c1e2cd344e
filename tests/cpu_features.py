"""What this CPU can run, for tests of features it is refused."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.rank import gemm
from engine.rank.cpp_library import MARCH_ENV

# decode_dtype="bfloat16" and packed bf16 weights need oneDNN's bf16 products (AVX512 or
# AVX-NE-CONVERT); on an AVX2-only CPU they are refused or never chosen, which
# tests/test_kernel_choice.py::test_without_onednn_bf16_* checks on any CPU
needs_onednn_bf16 = pytest.mark.skipif(
    not gemm.HAVE_ONEDNN_BF16, reason="oneDNN builds no bf16 products on this CPU (AVX2 only)")

# packed prompt copies are oneDNN's layout: a torch build without oneDNN never makes them
needs_onednn = pytest.mark.skipif(not gemm.HAVE_ONEDNN, reason="this torch has no oneDNN")

# transparent huge pages: a kernel built without them, or with them set to `never`
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE_PAGES_ON = _THP.exists() and "[never]" not in _THP.read_text()
needs_huge_pages = pytest.mark.skipif(
    not HUGE_PAGES_ON, reason="this kernel has transparent huge pages off")


def huge_page_kb(pid: int | str = "self") -> int:
    """A process's anonymous memory on transparent huge pages, in KiB (Linux)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return int(f.read().split("AnonHugePages:")[1].split()[0])


def run_in_a_build_for(march: str, cache: Path, code: str) -> str:
    """Run `code` in a process whose C++ kernels are built for another kind of CPU (-march)
    and run on this one, kept in `cache`: a process registers one build's torch-op kernels.
    Its output."""
    env = {**os.environ, MARCH_ENV: march, "PREFILL_ENGINE_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).parent.parent, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
