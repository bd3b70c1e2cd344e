"""What this CPU can run, for tests of features it is refused."""
from __future__ import annotations

import pytest

from engine.rank import gemm

# decode_dtype="bfloat16" and packed bf16 weights need oneDNN's bf16 products (AVX512 or
# AVX-NE-CONVERT); on an AVX2-only CPU they are refused or never chosen, which
# tests/test_kernel_choice.py::test_without_onednn_bf16_* checks on any CPU
needs_onednn_bf16 = pytest.mark.skipif(
    not gemm.HAVE_ONEDNN_BF16, reason="oneDNN builds no bf16 products on this CPU (AVX2 only)")

# packed prompt copies are oneDNN's layout: a torch build without oneDNN never makes them
needs_onednn = pytest.mark.skipif(not gemm.HAVE_ONEDNN, reason="this torch has no oneDNN")
