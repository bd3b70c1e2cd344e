"""engine.rank.gemm.linear: the model's projections through oneDNN on a CPU, checked against a
float64 matmul, eager and compiled, and the plain torch path where oneDNN cannot run."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.rank import gemm
from tests.cpu_features import needs_onednn, needs_onednn_bf16


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


@pytest.mark.parametrize("rows", [0, 1, 7, 300])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64(rows, dtype, tol, with_bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    w = torch.randn(80, 96, generator=gen).to(dtype) / 10
    b = torch.randn(80, generator=gen).to(dtype) if with_bias else None
    y = gemm.linear(x, w, b)
    assert y.shape == (rows, 80) and y.dtype == dtype
    ref = _reference(x, w, b)
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=tol * max(1.0, float(ref.abs().max()) if ref.numel() else 1.0))


def test_strided_input():
    """A transposed (non-contiguous) input gives the same rows as its contiguous copy."""
    x = torch.randn(40, 12).t()
    w = torch.randn(24, 40)
    torch.testing.assert_close(gemm.linear(x, w), gemm.linear(x.contiguous(), w))


def test_strided_weight():
    """A column slice of a weight (not contiguous) gives what its contiguous copy gives."""
    w = torch.randn(24, 100)[:, 10:50]
    x = torch.randn(7, 40)
    torch.testing.assert_close(gemm.linear(x, w), x @ w.contiguous().t())


def test_compiled_graph_keeps_onednn():
    """Inside torch.compile the op is opaque (inductor's own oneDNN lowering only takes weights
    it froze): the compiled function gives the eager numbers."""
    w, b = torch.randn(48, 32), torch.randn(48)

    def fn(x):
        return torch.relu(gemm.linear(x, w, b)) * 2

    compiled = torch.compile(fn, dynamic=True)
    for rows in (1, 5, 9):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(compiled(x), fn(x))


def test_without_onednn_uses_torch(monkeypatch):
    monkeypatch.setattr(gemm, "HAVE_ONEDNN", False)
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    assert torch.equal(gemm.linear(x, w), F.linear(x, w))


def test_float16_falls_back():
    """oneDNN has no CPU float16 inner product: torch's matmul serves it."""
    x, w = torch.randn(3, 16, dtype=torch.float16), torch.randn(8, 16, dtype=torch.float16)
    assert torch.equal(gemm.linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_compiled_decode_rows(rows, dtype, tol):
    """A graph compiled for a fixed 1 or 2 rows writes the product as a multiply-and-sum
    (inductor streams the weight once, a bf16 one widened as it reads, against bf16 rows
    widened once); 3 rows and up keep oneDNN where it runs the dtype. Both match float64."""
    uses_onednn = rows == 3 and gemm.onednn_runs(dtype)
    torch._dynamo.reset()  # each case compiles `fn` twice: no recompile limit across cases
    gen = torch.Generator().manual_seed(rows)
    w, b = (torch.randn(40, 64, generator=gen).to(dtype),
            torch.randn(40, generator=gen).to(dtype))
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def fn(x):
        return gemm.linear(x, w, b)

    got = torch.compile(fn, dynamic=False, backend=capture)(x)
    ops = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("onednn_linear" in op for op in ops) == uses_onednn, ops
    # bf16 rows widened into a buffer of their own once (gemm.widened_rows says why)
    assert any("inductor_force_stride_order" in op for op in ops) == (
        rows < 3 and dtype == torch.bfloat16), ops
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), _reference(x, w, b), rtol=0, atol=tol * 20)
    inductor = torch.compile(fn, dynamic=False)(x)
    torch.testing.assert_close(inductor.double(), _reference(x, w, b), rtol=0, atol=tol * 20)
    if rows < 3:  # summed in float32, rounded once: within one rounding of the exact product
        exact = _reference(x, w, b)
        torch.testing.assert_close(inductor.double(), exact.to(dtype).double(), rtol=2 ** -7,
                                   atol=1e-5)


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("compiled", [False, True])
def test_float32_rows_against_bf16_weight(rows, compiled):
    """decode_dtype's plain bf16 copies (compile=True keeps them unpacked): float32 rows in and
    out, the product as exact as bf16 inputs allow (the 1-row graph reads the weight in float32)."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(40, 64, generator=gen).to(torch.bfloat16)
    b, x = torch.randn(40, generator=gen), torch.randn(rows, 64, generator=gen)
    fn = torch.compile(gemm.linear, dynamic=False) if compiled else gemm.linear
    y = fn(x, w, b)
    assert y.dtype == torch.float32
    exact = x.double() @ w.double().t() + b.double()  # only x's rounding to bf16 may differ
    torch.testing.assert_close(y.double(), exact, rtol=1e-2, atol=0.05)
    if compiled and rows == 1:  # the multiply-and-sum keeps x in float32: near exact
        torch.testing.assert_close(y.double(), exact, rtol=0, atol=1e-4)


def _gated_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """SiLU(x Gᵀ) · (x Uᵀ) in float64, for w = [G; U]."""
    gate, up = (x.double() @ w.double().t()).chunk(2, -1)
    return F.silu(gate) * up


@needs_onednn
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5),
                                       pytest.param(torch.bfloat16, 2e-2, marks=needs_onednn_bf16)])
def test_gated_halves_match_float64(dtype, tol):
    """oneDNN's product of packed gate and up halves, with the SiLU and the product applied as
    it writes: the float64 formula, at a prompt's rows and at a few rows."""
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(160, 96, generator=gen) / 4).to(dtype)
    halves = gemm.pack_halves(w, 64)
    for rows in (3, 300):
        x = torch.randn(rows, 96, generator=gen).to(dtype)
        y, ref = gemm.gated_halves(x, *halves), _gated_reference(x, w)
        assert y.shape == (rows, 80) and y.dtype == dtype
        torch.testing.assert_close(y.double(), ref, rtol=0, atol=tol * max(1.0, float(ref.abs().max())))


@needs_onednn
@pytest.mark.parametrize("compiled", [False, True])
def test_gated_product_reads_halves_until_the_weight_is_written(monkeypatch, compiled):
    """A gate/up weight registered with halves: a prompt's rows go through them (eagerly and
    as the graph op), a decode-sized product and a weight written since take the product
    and a SiLU·mul; every one is the formula's. Its whole-weight lookup finds no copy."""
    copies = gemm.PromptCopies()
    monkeypatch.setattr(gemm, "PROMPT_COPIES", copies)
    used = []
    fused = gemm.gated_halves
    monkeypatch.setattr(gemm, "gated_halves", lambda x, g, u: used.append(len(x)) or fused(x, g, u))
    w = torch.randn(64, 32, requires_grad=False) / 4
    assert copies.add([w], 64, halves=True) == w.nbytes
    assert copies.find(w) is w and len(copies.find_halves(w)) == 2
    run = (torch.compile(lambda x, w: gemm.gated_product(x, w) * 1, dynamic=True) if compiled
           else gemm.eager_gated_product)
    for rows in (40, gemm.PLAIN_WEIGHT_ROWS):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(run(x, w).double(), _gated_reference(x, w), rtol=0, atol=1e-5)
    assert used == [40]
    w.mul_(-1)
    assert copies.find_halves(w) is None
    x = torch.randn(40, 32)
    torch.testing.assert_close(run(x, w).double(), _gated_reference(x, w), rtol=0, atol=1e-5)
    assert used == [40]
