"""A CPU rank keeps freed activation memory for reuse instead of handing it back to the OS.

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

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD = 2**30


def keep_freed_memory() -> bool:
    """Apply the thresholds above (glibc on Linux); False where there is no such allocator."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(_M_ARENA_MAX, 1))


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
