"""engine.rank.host_memory: with the thresholds raised, large temporaries allocated and freed
layer after layer reuse their pages instead of faulting in fresh ones each time."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = """
import resource, sys, torch
from engine.rank.host_memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
def layer():
    for n in range(1, 9):  # growing temporaries (2..16 MiB), as a prompt's attention blocks
        torch.ones(n * 2**19)  # allocated, every page touched, freed
layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    layer()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_large_temporaries_stop_faulting():
    applied, kept = _faults("keep")
    _, default = _faults("default")
    largest = 16 * 2**20 // os.sysconf("SC_PAGE_SIZE")  # pages of the largest temporary
    assert applied == "True"
    assert kept <= largest  # kept: the first layer's pages serve most of the next ten
    assert default > 5 * kept  # glibc's default: fresh pages again, layer after layer
