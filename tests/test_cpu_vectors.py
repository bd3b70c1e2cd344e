"""engine/rank/cpu_vectors.h's vector math, built for this CPU (tests/cpu_vectors_check.cpp):
exp_lanes against float64's e^x across float32's range, and the bf16 rounding of rounded_as
and store_narrowed against torch's own float32 -> bfloat16 conversion, bit for bit."""
from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.rank.cpp_library import CppLibrary

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64
CHECK = CppLibrary(Path(__file__).with_name("cpu_vectors_check.cpp"), "vector helpers check",
                   {"lanes_per_vector": [], "exp_of": [_ptr, _ptr, _i64],
                    "bf16_of": [_ptr, _ptr, _ptr, _i64]}, "nothing")


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    path = CHECK.build(tmp_path_factory.mktemp("vectors"), shutil.which("g++"))
    return CHECK.open(path)


def _padded(x: np.ndarray, lanes: int) -> np.ndarray:
    return np.ascontiguousarray(np.concatenate([x, np.zeros((-len(x)) % lanes)]), np.float32)


def test_exp_lanes_within_two_ulps(check):
    lanes = check.lanes_per_vector()
    x = _padded(np.concatenate([np.linspace(-87.0, 88.0, 200_003), [0.0, -0.0, 1.0, -1.0]]), lanes)
    out = np.empty_like(x)
    check.exp_of(x.ctypes.data, out.ctypes.data, len(x))
    want = np.exp(x.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(out - want) / ulp) <= 2.0
    # past +-88 the input is clamped: e^88 (finite), and e^-88 (a subnormal) for anything lower
    edges = _padded(np.array([100.0, 1e30, np.inf, -100.0, -np.inf, np.nan]), lanes)
    got = np.empty_like(edges)
    check.exp_of(edges.ctypes.data, got.ctypes.data, len(edges))
    assert np.allclose(got[:3], np.exp(np.float64(88.0)), rtol=1e-6)
    assert np.all((got[3:5] > 0) & (got[3:5] < 1e-37)) and np.isnan(got[5])


def test_bf16_rounding_is_torchs_bit_for_bit(check):
    lanes = check.lanes_per_vector()
    gen = torch.Generator().manual_seed(3)
    values = torch.cat([
        torch.randn(50_000, generator=gen) * 10.0 ** torch.randint(-30, 30, (50_000,), generator=gen),
        # exact ties between two bf16 values (the low 16 bits 0x8000), either parity
        (torch.arange(1, 4097, dtype=torch.int32) << 16 | 0x8000).view(torch.float32),
        torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.4e38, -3.4e38, 1e-45])])
    x = _padded(values.numpy(), lanes)
    rounded, stored = np.empty_like(x), np.empty(len(x), np.uint16)
    check.bf16_of(x.ctypes.data, rounded.ctypes.data, stored.ctypes.data, len(x))
    want = torch.from_numpy(x).bfloat16()
    assert np.array_equal(stored, want.view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(rounded, want.float().numpy())
    # NaNs, those whose payload lies in the low 16 bits too (truncated, they would read as
    # infinities), beside a normal value and a denormal (bit patterns throughout: a float64
    # copy on the way would quiet them)
    payloads = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7F80FFFF]
    for beside in (0x3F800000, 0x00000001):  # 1.0, the smallest denormal
        bits = payloads + [beside] + [0] * ((-len(payloads) - 1) % lanes)
        nan = np.array(bits, np.uint32).view(np.float32)
        check.bf16_of(nan.ctypes.data, rounded.ctypes.data, stored.ctypes.data, len(nan))
        assert np.isnan(rounded[:5]).all()
        assert np.isnan(torch.from_numpy(stored[:5].view(np.int16).copy()).view(torch.bfloat16).float()).all()
