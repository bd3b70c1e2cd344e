"""engine.rank.host_memory: with the thresholds raised, a large temporary comes from the heap
(reused once freed) rather than from pages mapped for it alone and unmapped on free, and a
thread started afterwards (the step thread of in-process ranks) allocates from that same main
heap rather than from an arena of its own."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# mallinfo2().hblks: blocks glibc mapped on their own; read while an 8 MiB tensor is alive
PROBE = """
import ctypes, sys, torch
from engine.rank.host_memory import keep_freed_memory
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
before = libc.mallinfo2().hblks
x = torch.ones(2 * 2**20)
print(applied, libc.mallinfo2().hblks - before)
"""
# malloc_stats() writes one "Arena N:" section per arena to stderr: is there a second one
# after a new thread allocated an 8 MiB tensor?
THREAD_PROBE = """
import ctypes, sys, threading, torch
from engine.rank.host_memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
kept = []
thread = threading.Thread(target=lambda: kept.append(torch.ones(2 * 2**20)))
thread.start()
thread.join()
print(applied, flush=True)
ctypes.CDLL("libc.so.6").malloc_stats()
"""


def _probe(probe: str, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", probe, mode], cwd=ROOT, capture_output=True,
                          text=True, check=True)


def _mapped_blocks(mode: str) -> tuple[str, int]:
    out = _probe(PROBE, mode).stdout.split()
    return out[0], int(out[1])


def _arenas(mode: str) -> tuple[str, int]:
    done = _probe(THREAD_PROBE, mode)
    return done.stdout.strip(), done.stderr.count("Arena ")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_large_temporaries_come_from_the_heap():
    assert _mapped_blocks("default") == ("None", 1)  # glibc's default: its own mapping
    assert _mapped_blocks("keep") == ("True", 0)  # kept: heap memory, reused after a free


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_later_thread_allocates_from_the_main_heap():
    applied, arenas = _arenas("default")
    assert applied == "None" and arenas > 1  # threads (this one, torch's) made arenas
    assert _arenas("keep") == ("True", 1)
