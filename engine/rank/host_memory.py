"""A CPU rank's memory: freed activations kept for reuse instead of handed back to the OS, and
the weights on transparent huge pages (back_with_huge_pages, below).

glibc serves a request above its mmap threshold with fresh pages and unmaps them when the
block is freed, so a prompt's temporaries (megabytes each: projections' outputs, attention
scores, allocated and freed in every layer) fault in new pages on every first touch. Raising
the threshold, and the trim threshold above it, makes them reuse heap memory: a bf16 blocked
attention of 2048 tokens ran in 14 ms instead of 19 ms (AVX512-BF16 EPYC, 2 threads). The
cost: a rank process keeps up to TRIM_THRESHOLD of freed memory mapped after a large step.
The setting is process-wide: with one in-process rank it applies to the caller's process.

Threads get the main arena too (M_ARENA_MAX=1): a thread's own arena is built of 64 MB heaps
that glibc unmaps whenever one empties, whatever the trim threshold, so a step thread's
temporaries faulted in fresh pages all the same (a 512-token bf16 prompt through
compile=True's one-layer graphs: ~400 faults and 12 % slower on the AMX Xeon, none with it).
An arena is a thread's from its first allocation, so LLM applies this before it starts the
thread that runs in-process ranks. The cost: threads allocating at once share one lock.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable, Iterable

import torch

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # mallopt parameters (malloc.h)
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25  # madvise advice (linux/mman.h; COLLAPSE: Linux 6.1)
HUGE_PAGE = 2 * 2**20  # x86-64's transparent huge page
# storages at most this far apart count as one span: the huge pages across the gap between two
# weights (other blocks of the heap) hold parts of both
MERGED_GAP = HUGE_PAGE
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD = 2**30


def keep_freed_memory() -> bool:
    """Apply the thresholds above (glibc on Linux); False where there is no such allocator."""
    mallopt = getattr(_libc(), "mallopt", None)  # musl and other C libraries have none
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(_M_ARENA_MAX, 1))


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def _memory(tensor: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the memory a tensor lives in: its storage, or for a oneDNN-packed
    weight (opaque to torch, engine.rank.gemm) the buffer oneDNN holds it in."""
    if tensor.is_mkldnn:
        return torch.ops.mkldnn.data_ptr(tensor), torch.ops.mkldnn._nbytes(tensor)
    return tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()


def huge_page_spans(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """(start, end) of the whole 2 MB pages inside the tensors' storages; storages laid out
    next to each other (the heap's neighbours) count as one span, so a run of small weights
    can fill a huge page none of them fills alone."""
    storages = sorted({_memory(t) for t in tensors if t.device.type == "cpu"})
    merged: list[list[int]] = []
    for start, nbytes in storages:
        if merged and start - merged[-1][1] <= MERGED_GAP:
            merged[-1][1] = max(merged[-1][1], start + nbytes)
        else:
            merged.append([start, start + nbytes])
    aligned = ((-(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE)
               for start, end in merged)
    return [(start, end) for start, end in aligned if end > start]


def _madvise() -> Callable[[int, int, int], int] | None:
    madvise = getattr(_libc(), "madvise", None)
    if madvise is not None:
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def back_with_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Move the tensors' memory onto transparent huge pages now, as far as Linux can: a
    decode step streams every weight once, and with 4 KB pages half a gigabyte of weights is
    ~130k TLB misses a step (the decode figures: BENCHMARKS.md, session 48); prompts, which
    reuse each weight across their rows, gain nothing measurable. The weights sit in pages
    already touched, which asking for huge pages (MADV_HUGEPAGE) alone would leave to
    khugepaged, a page at a time over minutes; MADV_COLLAPSE copies them now, whatever the
    system's THP setting short of `never`. Returns the bytes of huge pages that hold them
    now: 0 before Linux 6.1, on another OS, or where the kernel had none to give."""
    madvise, moved = _madvise(), 0
    for start, end in huge_page_spans(tensors) if madvise is not None else ():
        madvise(start, end - start, _MADV_HUGEPAGE)  # and keep them so (no split on a fault)
        # page by page: a call stops at the first page it cannot move (one past the end of
        # its mapping, where a span crossed into the next), and says nothing of the others
        for page in range(start, end, HUGE_PAGE):
            if madvise(page, HUGE_PAGE, _MADV_COLLAPSE) == 0:
                moved += HUGE_PAGE
    return moved


def available_bytes() -> int | None:
    """Memory the OS could hand this process now without swapping (Linux's MemAvailable);
    None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
