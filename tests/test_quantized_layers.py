"""engine.rank.quantized_layers: a decode layer's two C++ halves (quantized_rows.cpp) against a
float64 layer written here (RMSNorm, the weights dequantized by hand from their codes, RoPE by
its formula, softmax attention over each row's context read through its block table, SiLU·mul),
for int8 and int4 weights, float32 and bf16, rows past the products' 4 at a time, query groups
and a QKV bias; the KV cache holding the rotated K and V afterwards; refusals; and an engine
whose decode steps run them, with the tokens of its float twin."""
from __future__ import annotations

import math

import pytest
import torch

from engine.rank import fused_attention
from engine.rank import quantized_rows as qr
from engine.rank.quantized import int4_groups, int8_per_channel

HQ, HKV, HD, D, FFN = 4, 2, 32, 64, 96
BLOCK, BLOCKS, LAYERS, LAYER = 4, 32, 2, 1  # 4 blocks a row, none shared
EPS = 1e-5
# bound on |got - want| over the largest |want|: float32's is the int16 rounding of x (int4) and
# float32 sums; bf16's is its 2^-8 rounding at each of the layer's ~6 rounded steps
BOUND = {torch.float32: 5e-4, torch.bfloat16: 3e-2}  # measured: 1.1e-4, 8.3e-3
QUANTIZE = {"int8": int8_per_channel, "int4": int4_groups}


@pytest.fixture(autouse=True)
def _libraries():
    """The halves' kernels, and the attention's they call, registered (built if need be)."""
    assert qr.available("int4") and fused_attention.available()


def _dequantized(weight) -> torch.Tensor:
    """The float64 weight its codes stand for: int8 q s; int4 d q + m per group of 32, the
    group's code i in the low nibble of byte i and code i + 16 in the high one."""
    if weight.kind == "int8":
        return weight.codes.double() * weight.scales.double()[:, None]
    n, k = weight.shape
    nibbles = weight.nibbles.view(n, k // 32, 16).long()
    codes = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).double()
    d, m = (weight.steps[i].double().view(n, k // 32, 1) for i in (0, 1))
    return (d * codes + m).view(n, k)


def _pair(weight) -> tuple[torch.Tensor, torch.Tensor]:
    return (weight.codes, weight.scales) if weight.kind == "int8" else (weight.nibbles, weight.steps)


def _norm(x, residual, w):
    s = (x + residual).double()  # the sum is rounded to the dtype: it is the next residual
    return w.double() * s / torch.sqrt((s * s).mean(-1, keepdim=True) + EPS)


def _rotated(t, cos, sin):
    half = t.shape[-1] // 2
    x1, x2 = t[..., :half], t[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class Setup:
    """A layer's weights, a cache with earlier context, and a decode step of `rows` rows."""

    def __init__(self, kind: str, dtype: torch.dtype, rows: int, bias: bool):
        gen = torch.Generator().manual_seed(rows + 7 * bias)
        rand = lambda *shape, s=1.0: (torch.randn(*shape, generator=gen) * s).to(dtype)
        self.dtype = dtype
        self.x, self.residual, self.norm = rand(rows, D), rand(rows, D), 1 + rand(D, s=0.1)
        self.qkv = QUANTIZE[kind](rand((HQ + 2 * HKV) * HD, D, s=0.2))
        self.o = QUANTIZE[kind](rand(D, HQ * HD, s=0.1))
        self.gate_up = QUANTIZE[kind](rand(2 * FFN, D, s=0.2))
        self.down = QUANTIZE[kind](rand(D, FFN, s=0.1))
        self.bias = rand((HQ + 2 * HKV) * HD) if bias else None
        angles = torch.outer(torch.arange(64.0), 1.0 / 10000 ** (torch.arange(0, HD, 2) / HD))
        self.cos, self.sin = angles.cos(), angles.sin()
        self.cache = rand(2, LAYERS, BLOCKS, BLOCK, HKV, HD)
        # row r: a context of lens[r] tokens over blocks of its own, in no order
        self.lens = [1 + (5 * r + 3) % 14 for r in range(rows)]
        order = torch.randperm(BLOCKS, generator=gen).tolist()
        self.table = [order[(r * 4) % BLOCKS:(r * 4) % BLOCKS + 4] for r in range(rows)]
        self.slots = [t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK
                      for t, n in zip(self.table, self.lens)]

    def run_attention(self):
        as_int = lambda v: torch.tensor(v, dtype=torch.int32)
        return qr.quantized_attention_half(
            self.x, self.residual, self.norm, EPS, *_pair(self.qkv), self.bias, *_pair(self.o),
            self.cos, self.sin, as_int([n - 1 for n in self.lens]), self.cache, LAYER,
            as_int(self.slots), as_int(self.table), as_int(self.lens), HQ, HD ** -0.5)

    def want_attention(self, cache_before: torch.Tensor):
        """(the O product, the rotated new K and V [rows, HKV, HD]) in float64."""
        qkv = _norm(self.x, self.residual, self.norm) @ _dequantized(self.qkv).T
        if self.bias is not None:
            qkv = qkv + self.bias.double()
        outs, new_k, new_v = [], [], []
        for r, n in enumerate(self.lens):
            c, s = self.cos[n - 1].double(), self.sin[n - 1].double()
            heads = qkv[r].view(HQ + 2 * HKV, HD)
            q, k = _rotated(heads[:HQ], c, s), _rotated(heads[HQ:HQ + HKV], c, s)
            v = heads[HQ + HKV:]
            slots = [self.table[r][i // BLOCK] * BLOCK + i % BLOCK for i in range(n - 1)]
            flat = cache_before[:, LAYER].reshape(2, -1, HKV, HD).double()
            keys = torch.cat([flat[0, slots], k[None]])  # [n, HKV, HD]
            values = torch.cat([flat[1, slots], v[None]])
            group = HQ // HKV
            scores = torch.einsum("hd,nhd->hn", q, keys.repeat_interleave(group, 1)) / math.sqrt(HD)
            out = torch.einsum("hn,nhd->hd", scores.softmax(-1), values.repeat_interleave(group, 1))
            outs.append(out.flatten())
            new_k.append(k)
            new_v.append(v)
        return torch.stack(outs) @ _dequantized(self.o).T, torch.stack(new_k), torch.stack(new_v)

    def want_mlp(self):
        gate_up = _norm(self.x, self.residual, self.norm) @ _dequantized(self.gate_up).T
        gate, up = gate_up[:, :FFN], gate_up[:, FFN:]
        return (gate * torch.sigmoid(gate) * up) @ _dequantized(self.down).T


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    error = (got.double() - want).abs().max() / want.abs().max()
    assert error < BOUND[dtype], f"{error:.2e} of the largest |value|"


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_attention_half_matches_float64(kind, dtype, rows):
    setup = Setup(kind, dtype, rows, bias=rows == 3)
    before = setup.cache.clone()
    out, residual = setup.run_attention()
    want, new_k, new_v = setup.want_attention(before)
    _close(out, want, dtype)
    assert torch.equal(residual, setup.x + setup.residual)  # torch's own rounded sum
    # the new K (rotated) and V in their slots; nothing else in the cache moved
    flat = setup.cache[:, LAYER].reshape(2, -1, HKV, HD)
    _close(flat[0, setup.slots], new_k, dtype)
    _close(flat[1, setup.slots], new_v, dtype)
    moved = (setup.cache != before).flatten(2).any(-1)  # [2, layers]: k/v of each layer
    assert moved.tolist() == [[False, True], [False, True]]
    untouched = [s for s in range(BLOCKS * BLOCK) if s not in setup.slots]
    assert torch.equal(flat[:, untouched], before[:, LAYER].reshape(2, -1, HKV, HD)[:, untouched])


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 6])
def test_mlp_half_matches_float64(kind, dtype, rows):
    setup = Setup(kind, dtype, rows, bias=False)
    out, residual = qr.quantized_mlp_half(setup.x, setup.residual, setup.norm, EPS,
                                          *_pair(setup.gate_up), None, *_pair(setup.down))
    _close(out, setup.want_mlp(), dtype)
    assert torch.equal(residual, setup.x + setup.residual)


def test_refusals_name_the_problem():
    setup = Setup("int4", torch.float32, 2, bias=False)
    # o_proj's weight where gate/up's goes
    with pytest.raises(ValueError, match="gate_up_proj takes 128 inputs, the layer gives it 64"):
        qr.quantized_mlp_half(setup.x, setup.residual, setup.norm, EPS, *_pair(setup.o), None,
                              *_pair(setup.down))
    with pytest.raises(ValueError, match="of the activations' dtype"):
        qr.quantized_mlp_half(setup.x.bfloat16(), setup.residual.bfloat16(),
                              setup.norm.bfloat16(), EPS, *_pair(setup.gate_up), None,
                              *_pair(setup.down))
    setup.lens[0] = 65  # past the rotary tables' 64 positions
    with pytest.raises(IndexError, match="position 64 outside the rotary tables' 64"):
        setup.run_attention()
    setup.lens[0] = 2
    setup.slots[1] = BLOCKS * BLOCK  # one past the cache
    before = setup.cache.clone()
    with pytest.raises(IndexError, match="outside the KV cache"):
        setup.run_attention()
    assert torch.equal(setup.cache, before)  # nothing written
    with pytest.raises(IndexError, match="layer 2 of a cache of 2 layers"):
        qr.quantized_attention_half(
            setup.x, setup.residual, setup.norm, EPS, *_pair(setup.qkv), None, *_pair(setup.o),
            setup.cos, setup.sin, torch.ones(2, dtype=torch.int32), setup.cache, 2,
            torch.zeros(2, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32),
            torch.ones(2, dtype=torch.int32), HQ, 1.0)
