"""engine.rank.layer_ops: the C++ RMSNorm (with its residual add), RoPE and SiLU·mul against
the math in float64 and against engine.rank.ops, whose roundings they repeat; in a compiled
prompt graph the ops are called, in a decode graph's few fixed rows inductor's code runs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.rank import layer_ops, ops
from engine.rank.backend import cpu_torch
from engine.rank.gemm import EAGER_ROWS

# float32: the sum of squares in another order and fused multiply-adds, a few ulps;
# bf16: each result rounds to bf16 (2^-9 relative) after an intermediate rounding
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}


@pytest.fixture(scope="module")
def backend():
    assert layer_ops.available(), "the C++ layer ops did not build (is g++ installed?)"
    chosen = cpu_torch()
    assert (chosen.rmsnorm, chosen.rope, chosen.silu_mul) == (
        layer_ops.rmsnorm, layer_ops.rope, layer_ops.silu_mul)
    return chosen


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(out.double(), ref, rtol=RTOL[dtype], atol=1e-5)


def _mostly_equal(out: torch.Tensor, torch_ops_out: torch.Tensor, dtype: torch.dtype) -> None:
    """bf16: the same values as engine.rank.ops's but for a last-bit rounding in a few."""
    if dtype == torch.bfloat16:
        assert (out != torch_ops_out).float().mean() < 2e-3
    _close(out, torch_ops_out.double(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,d", [(1, 576), (7, 50), (300, 64)])
def test_add_rmsnorm_is_the_norm_of_the_sum(backend, dtype, rows, d):
    torch.manual_seed(rows)
    x, residual = torch.randn(rows, d, dtype=dtype), torch.randn(rows, d, dtype=dtype)
    weight = torch.randn(d, dtype=dtype)
    normed, summed = backend.rmsnorm(x, residual, weight, 1e-5)
    assert torch.equal(summed, x + residual)  # torch's add in the dtype, exactly
    s = summed.double()
    ref = weight.double() * s / (s.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    _close(normed, ref, dtype)
    _mostly_equal(normed, ops.rmsnorm(x, residual, weight, 1e-5)[0], dtype)


def test_bf16_sums_round_as_torch_at_ties_and_special_values(backend):
    """The vector rounding to bf16 against torch's add in bf16: ties to even, sums past bf16's
    largest value to inf, NaN and the infinities kept, on whole vectors and the scalar tail."""
    big = torch.finfo(torch.bfloat16).max
    x = torch.tensor([1.0, 1.0 + 2 ** -7, big, -big, float("nan"), float("inf"), -float("inf"),
                      float("inf"), 3.0, 0.0, -0.0, 2 ** -100, 1.0, -1.0, 7.0, 0.5] * 2 + [1.0],
                     dtype=torch.bfloat16)
    # 1 + 2^-8 lies halfway between two bf16 neighbours (1 and 1 + 2^-7): to the even one
    residual = torch.tensor([2 ** -8, 2 ** -8, big, -big, 1.0, 1.0, 1.0, -float("inf"), -3.0,
                             -0.0, -0.0, 2 ** -100, 2 ** -8 + 2 ** -14, -2 ** -8 + 2 ** -15,
                             2 ** -6, 2 ** -9] * 2 + [2 ** -8],
                            dtype=torch.bfloat16)
    _, summed = backend.rmsnorm(x[None], residual[None], torch.ones_like(x), 1e-5)
    torch.testing.assert_close(summed[0], x + residual, rtol=0, atol=0, equal_nan=True)


def _rotated_by_complex(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
    """(x1 + i x2) e^{i p f} in float64: the rotate-half rotation, written independently."""
    turn = torch.polar(torch.ones(len(positions), len(inv_freq), dtype=torch.float64),
                       torch.outer(positions.double(), inv_freq)).unsqueeze(1)
    x1, x2 = x.double().chunk(2, dim=-1)
    z = torch.complex(x1, x2) * turn
    return torch.cat((z.real, z.imag), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64, 96])  # half of 16 is below a vector's 16 floats
@pytest.mark.parametrize("rows,index", [(1, torch.int64), (9, torch.int32)])
def test_rope_rotates_q_and_k_at_their_positions(backend, dtype, head_dim, rows, index):
    torch.manual_seed(head_dim)
    hq, hkv, max_positions = 6, 2, 4096
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    cos, sin = angles.cos().float(), angles.sin().float()
    # q and k as the QKV projection leaves them: strided views of one buffer, v after them
    qkv = torch.randn(rows, (hq + 2 * hkv) * head_dim, dtype=dtype)
    q = qkv[:, :hq * head_dim].view(rows, hq, head_dim)
    k = qkv[:, hq * head_dim:(hq + hkv) * head_dim].view(rows, hkv, head_dim)
    positions = torch.randint(0, max_positions, (rows,), dtype=index)
    q_out, k_out = backend.rope(positions, q, k, cos, sin)
    for out, x in ((q_out, q), (k_out, k)):
        _close(out, _rotated_by_complex(x, positions, inv_freq), dtype)
    for out, torch_ops_out in zip((q_out, k_out), ops.rope(positions, q, k, cos, sin)):
        _mostly_equal(out, torch_ops_out, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 1536), (5, 37)])
def test_silu_mul_is_silu_of_gate_times_up(backend, dtype, rows, n):
    torch.manual_seed(n)
    gate_up = torch.randn(rows, 2 * n, dtype=dtype) * 6  # well into both tails of the SiLU
    out = backend.silu_mul(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    _close(out, gate * torch.sigmoid(gate) * up, dtype)
    _mostly_equal(out, ops.silu_mul(gate_up), dtype)


def test_ops_refuse_what_they_cannot_compute(backend):
    cos = sin = torch.zeros(8, 8)
    q, k = torch.randn(2, 3, 16), torch.randn(2, 1, 16)
    with pytest.raises(IndexError, match="position 8 lies outside the tables' 8 positions"):
        layer_ops.rope_op(torch.tensor([0, 8]), q, k, cos, sin)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        layer_ops.rope_op(torch.tensor([0, 1]), q, k.bfloat16(), cos, sin)
    with pytest.raises(RuntimeError, match=r"x and residual \[rows, d\] and a weight \[d\]"):
        layer_ops.add_rmsnorm_op(torch.randn(2, 8), torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match=r"a gate/up product \[rows, 2 n\]"):
        layer_ops.silu_mul_op(torch.randn(2, 7))
    # the engine's ops, given what the C++ does not take (float16), run torch's
    x = torch.randn(2, 8, dtype=torch.float16)
    assert torch.equal(backend.silu_mul(x), ops.silu_mul(x))


def _graph_ops(backend, rows: int, dynamic: bool) -> set:
    """The targets of the graph dynamo traces from a norm and a SiLU·mul of `rows` rows."""
    seen = set()

    def record(gm: torch.fx.GraphModule, inputs) -> object:
        seen.update(node.target for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    def layer(x, residual, weight):
        h, residual = backend.rmsnorm(x, residual, weight, 1e-5)
        return backend.silu_mul(torch.cat((h, h), -1)), residual

    x, residual, weight = torch.randn(rows, 32), torch.randn(rows, 32), torch.randn(32)
    if dynamic:  # as the engine's prompt graph marks its rows (engine.rank.compiled)
        for t in (x, residual):
            torch._dynamo.mark_dynamic(t, 0, min=EAGER_ROWS + 1, max=2**24)
    torch._dynamo.reset()
    out, _ = torch.compile(layer, backend=record, fullgraph=True, dynamic=False)(x, residual,
                                                                                  weight)
    h = ops.rmsnorm(x, residual, weight, 1e-5)[0]
    torch.testing.assert_close(out, ops.silu_mul(torch.cat((h, h), -1)))
    return seen


def test_prompt_graphs_call_the_ops_and_decode_graphs_keep_torchs(backend):
    ours = {torch.ops.prefill.add_rmsnorm.default, torch.ops.prefill.silu_mul.default}
    assert ours <= _graph_ops(backend, 16, dynamic=True)
    assert not ours & _graph_ops(backend, EAGER_ROWS, dynamic=False)
    assert F.silu in _graph_ops(backend, EAGER_ROWS, dynamic=False)
