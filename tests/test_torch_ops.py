"""engine.rank.ops, the CPU path's small ops: RoPE against the rotation written as complex
multiplication, whether q and k sit side by side in the QKV projection's output (one pass over
both) or apart."""
from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.rank import layer_ops, ops

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
@pytest.mark.parametrize("inference", [True, False])  # the engine's steps run in inference mode
def test_rope_side_by_side_and_apart_is_the_rotation(rows, dtype, atol, inference):
    with torch.inference_mode(inference):
        _check_rope(rows, dtype, atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_a_compiled_graph_gives_the_eager_values(dtype):
    """A graph swaps the halves by two slices where eager rolls them (ops._rotated): the same
    rotation, bitwise, against the float64 rotation too."""
    gen = torch.Generator().manual_seed(1)
    cos, sin = _tables(512)
    positions = torch.randint(0, 512, (37,), generator=gen)
    qkv = torch.randn(37, (HQ + 2 * HKV) * D, generator=gen).to(dtype)
    q, k, _ = (t.view(37, -1, D) for t in qkv.split([HQ * D, HKV * D, HKV * D], dim=1))
    compiled = torch.compile(ops.rope, backend="inductor", fullgraph=True)
    for got, want, x in zip(compiled(positions, q, k, cos, sin),
                            ops.rope(positions, q, k, cos, sin), (q, k)):
        assert torch.equal(got, want)
        torch.testing.assert_close(got.double(), _by_complex(x, positions), rtol=0,
                                   atol=1e-5 if dtype == torch.float32 else 3e-2)


def _check_rope(rows: int, dtype: torch.dtype, atol: float) -> None:
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
    assert ops._side_by_side(q[:-1], k[:-1]) is not None and ops._side_by_side(q[1:], k) is None
    elsewhere = qkv.clone()[:, HQ * D:(HQ + HKV) * D].view(rows, HKV, D)  # k's place, another tensor
    assert elsewhere.storage_offset() == k.storage_offset() and ops._side_by_side(q, elsewhere) is None
    assert torch.equal(qkv, before)  # the inputs are read, never written
    for got, other, x in zip(one_pass, apart, (q, k)):
        assert got.shape == x.shape and got.dtype == dtype
        assert torch.equal(got, other)  # the same roundings either way
        torch.testing.assert_close(got.double(), _by_complex(x, positions), rtol=0, atol=atol)


def test_an_engine_step_rotates_q_and_k_in_one_pass(tiny_model_dir, monkeypatch):
    """In the engine's own steps (inference mode, the QKV projection's output) every layer's
    RoPE is one rotation over q's and k's heads together, at cos/sin rows gathered once per
    step, and the tokens are those of the rotation done apart: torch's path, which a CPU rank
    runs where the C++ layer ops (engine.rank.layer_ops) do not build."""
    monkeypatch.setattr(layer_ops, "available", lambda: False)
    cfg = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    heads = cfg["num_attention_heads"] + cfg["num_key_value_heads"]
    rotated, rotate = [], ops._rotated
    monkeypatch.setattr(ops, "_rotated", lambda x, c, s: rotated.append(x.shape[1]) or rotate(x, c, s))
    gathered, rope_rows = [], ops.rope_rows
    monkeypatch.setattr(ops, "rope_rows", lambda p, c, s: gathered.append(len(p)) or rope_rows(p, c, s))
    prompts, params = [[5, 9, 2, 7, 11, 3, 8, 1] * 3, [4, 4, 6]], SamplingParams(max_tokens=4)
    with LLM(str(tiny_model_dir("llama")), kernel_choice="fixed") as llm:
        one_pass = [o.token_ids for o in llm.generate(prompts, params)]
        # a prompt step, then 3 decode steps, each through every layer once
        assert rotated == [heads] * (4 * cfg["num_hidden_layers"])
        # each step's cos/sin rows gathered once, by its first layer, at its own rows
        assert gathered == [27, 2, 2, 2]
        monkeypatch.setattr(ops, "_side_by_side", lambda q, k: None)
        rotated.clear()
        apart = [o.token_ids for o in llm.generate(prompts, params)]
        assert set(rotated) == {cfg["num_attention_heads"], cfg["num_key_value_heads"]}
    assert one_pass == apart
