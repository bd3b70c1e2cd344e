"""engine.rank.host_memory: with the thresholds raised, a large temporary comes from the heap
(reused once freed) rather than from pages mapped for it alone and unmapped on free, and a
thread started afterwards (the step thread of in-process ranks) allocates from that same main
heap rather than from an arena of its own."""
from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys

import pytest
import torch

from engine.rank.host_memory import MERGED_GAP, huge_page_spans
from tests.cpu_features import huge_page_kb, needs_huge_pages, needs_onednn

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


def test_huge_page_spans_are_the_whole_pages_inside_neighbouring_storages():
    """Storages less than MERGED_GAP apart (the heap's neighbours) count as one span, which
    gives the 2 MiB pages it holds whole: two that hold no whole page alone give one together;
    a storage further off gives its own."""
    mib = 2**20
    assert MERGED_GAP < 3 * mib
    buffer = ctypes.create_string_buffer(16 * mib)
    base = -(-ctypes.addressof(buffer) // (2 * mib)) * (2 * mib)  # the first 2 MiB boundary
    offset = base - ctypes.addressof(buffer)

    def at(start: int, nbytes: int) -> torch.Tensor:  # a storage of its own at base + start
        return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset + start)

    first, second = at(mib, 3 * mib // 2), at(3 * mib, 3 * mib // 2)  # 0.5 MiB apart
    far = at(15 * mib // 2, 3 * mib)  # 3 MiB after the second ends
    assert huge_page_spans([first]) == huge_page_spans([second]) == []
    assert huge_page_spans([far, second, second[10:], first]) == [
        (base + 2 * mib, base + 4 * mib), (base + 8 * mib, base + 10 * mib)]


MOVE_PROBE = """
import ctypes, sys, torch
from engine.rank import gemm
from engine.rank.host_memory import back_with_huge_pages
from tests.cpu_features import huge_page_kb
torch.manual_seed(0)
weight, x = torch.randn(4096, 2048), torch.randn(3, 2048)  # a 32 MiB weight, in 4 KiB pages
if sys.argv[1] == "packed":  # in oneDNN's layout: a buffer torch sees no storage of
    weight = gemm.pack_for_rows(weight, 512)
if sys.argv[1] == "refused":  # this process may have no huge pages (PR_SET_THP_DISABLE)
    assert ctypes.CDLL("libc.so.6").prctl(41, 1, 0, 0, 0) == 0
before, product = huge_page_kb(), gemm.linear(x, weight)
moved = back_with_huge_pages([weight])
print(moved, huge_page_kb() - before, torch.equal(gemm.linear(x, weight), product))
"""


@pytest.mark.parametrize("layout", ["plain", pytest.param("packed", marks=needs_onednn)])
@needs_huge_pages
def test_a_large_weight_moves_onto_huge_pages_with_its_values(layout):
    moved, gained_kb, same = _probe(MOVE_PROBE, layout).stdout.split()
    assert int(moved) >= 30 * 2**20  # the 15 whole 2 MiB pages of any 32 MiB span
    assert int(gained_kb) * 1024 >= int(moved)
    assert same == "True"  # the product reads the same values after the move


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="prctl through glibc")
def test_a_process_refused_huge_pages_moves_nothing_and_keeps_its_values():
    assert _probe(MOVE_PROBE, "refused").stdout.split() == ["0", "0", "True"]


@needs_huge_pages
def test_an_engines_weights_sit_on_huge_pages(smollm2_llm):
    """SmolLM2's float32 weights are 538 MB (134.5M parameters); the rank moved most of them,
    and the process's huge pages hold at least what it says."""
    [info] = smollm2_llm.rank_info()
    assert 384 * 2**20 <= info.huge_page_bytes <= info.weight_bytes
    assert huge_page_kb(info.pid) * 1024 >= info.huge_page_bytes
