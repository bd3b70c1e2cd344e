"""The tile and split sizes the kernels launch with, in one place.

The CUDA path and the tests both read these, so a test "at the GPU's configuration" runs exactly
the tile sizes a GPU would, under the interpreter. The interpreter's own defaults are smaller so
that the tiny shapes of the other tests and of the engine-level test still span several tiles.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class KernelDefaults:
    """Launch sizes of the attention kernels on one kind of device."""

    prefill_block_m: int  # packed query rows per program: tokens x query heads of one KV head
    prefill_block_n: int  # keys per inner step
    prefill_block_n_wide: int  # keys per step for head_dim > 128 (shared memory)
    prefill_num_warps: int
    prefill_num_stages: int
    decode_block_n: int  # keys per inner step of a decode split
    decode_min_split: int  # fewest keys per decode split (a multiple of decode_block_n)


# What a CUDA device runs when autotuning is off, and the first config the autotuner tries.
# 128 packed rows x 64 keys with 8 warps is the usual flash-attention tile for head dim <= 128;
# 256-key splits keep decode's partial writes and merge small next to the K/V it reads.
GPU_DEFAULTS = KernelDefaults(prefill_block_m=128, prefill_block_n=64, prefill_block_n_wide=32,
                              prefill_num_warps=8, prefill_num_stages=3,
                              decode_block_n=64, decode_min_split=256)
# Under the interpreter a program costs about the same whatever its tile, and the tests' shapes
# are tiny: 16-wide tiles make them cross tile boundaries.
INTERPRETER_DEFAULTS = KernelDefaults(prefill_block_m=16, prefill_block_n=16,
                                      prefill_block_n_wide=16, prefill_num_warps=4,
                                      prefill_num_stages=1, decode_block_n=16,
                                      decode_min_split=16)

# The autotuner's search space for the flash prefill on Hopper-class GPUs (block_m, block_n,
# warps, stages), GPU_DEFAULTS first. Configs over the shared-memory limit are skipped by the
# autotuner itself (it catches that config's out-of-resources error).
_DEFAULT_TILE = (GPU_DEFAULTS.prefill_block_m, GPU_DEFAULTS.prefill_block_n,
                 GPU_DEFAULTS.prefill_num_warps, GPU_DEFAULTS.prefill_num_stages)
PREFILL_TUNE_SPACE = [_DEFAULT_TILE] + [
    (m, n, w, s) for m, n, w in ((128, 64, 8), (128, 64, 4), (64, 64, 4), (128, 128, 8))
    for s in (2, 3, 4) if (m, n, w, s) != _DEFAULT_TILE]  # 12 configs: ~30 s of compiling


# Token counts the prefill is tuned for: a step is tuned as the smallest bucket holding its token
# count (the largest beyond it). A tile that wins at 16k tokens loses at 1k (fewer programs than
# SMs), so one tuning for every length is wrong; a power of four keeps the warm-up short.
TUNE_TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384)


def tune_bucket(num_tokens: int) -> int:
    """The autotuner's key for a step of `num_tokens` new tokens."""
    return next((b for b in TUNE_TOKEN_BUCKETS if num_tokens <= b), TUNE_TOKEN_BUCKETS[-1])


def tuning_steps(max_step_tokens: int, max_len: int) -> list[tuple[int, int]]:
    """One prompt step per bucket that steps of at most `max_step_tokens` tokens fall in, as
    (tokens per sequence <= max_len, sequences): what a warm-up runs to tune every bucket."""
    steps = []
    for size in sorted({min(b, max_step_tokens) for b in TUNE_TOKEN_BUCKETS}):
        seqs = -(-size // max_len)
        # of the two even splits, one whose total stays in size's bucket
        per = next(n for n in (size // seqs, -(-size // seqs))
                   if tune_bucket(n * seqs) == tune_bucket(size))
        steps.append((per, seqs))
    return steps


def defaults_for(device: torch.device | str) -> KernelDefaults:
    return GPU_DEFAULTS if torch.device(device).type == "cuda" else INTERPRETER_DEFAULTS


@lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device, asked once per process (not per layer)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
