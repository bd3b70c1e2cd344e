"""engine.rank.ops, the CPU path's small ops: RoPE against the rotation written as complex
multiplication, whether q and k sit side by side in the QKV projection's output (one pass over
both) or apart."""
from __future__ import annotations

import pytest
import torch

from engine.rank import ops

HQ, HKV, D = 6, 2, 16


def _tables(max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def _by_complex(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(x1 + i x2) e^{i angle}, in float64: the rotate-half rotation, independently written."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    turn = torch.polar(torch.ones(len(positions), D // 2, dtype=torch.float64),
                       torch.outer(positions.double(), inv_freq)).unsqueeze(1)
    x1, x2 = x.double().chunk(2, dim=-1)
    z = torch.complex(x1, x2) * turn
    return torch.cat((z.real, z.imag), dim=-1)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_rope_side_by_side_and_apart_is_the_rotation(rows, dtype, atol):
    gen = torch.Generator().manual_seed(0)
    cos, sin = _tables(512)
    positions = torch.randint(0, 512, (rows,), generator=gen)
    qkv = torch.randn(rows, (HQ + 2 * HKV) * D, generator=gen).to(dtype)
    before = qkv.clone()
    q, k, v = (t.view(rows, -1, D) for t in qkv.split([HQ * D, HKV * D, HKV * D], dim=1))
    assert ops._side_by_side(q, k) is not None  # the one-pass path is the one taken here
    one_pass = ops.rope(positions, q, k, cos, sin)
    apart = ops.rope(positions, q.clone(), k.clone(), cos, sin)  # copies: one tensor each
    assert ops._side_by_side(q.clone(), k) is None and ops._side_by_side(k, q) is None
    assert ops._side_by_side(v, k) is None
    assert torch.equal(qkv, before)  # the inputs are read, never written
    for got, other, x in zip(one_pass, apart, (q, k)):
        assert got.shape == x.shape and got.dtype == dtype
        assert torch.equal(got, other)  # the same roundings either way
        torch.testing.assert_close(got.double(), _by_complex(x, positions), rtol=0, atol=atol)
