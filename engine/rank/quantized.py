"""`weights="int8" | "int4" | "gguf"`: the projections held as integer codes and scales, and
multiplied by torch's weight-only CPU kernels or, for a few rows where timed faster, the
engine's own (engine.rank.quantized_rows); activations stay float32 or bfloat16.

- int8: per output channel, symmetric: w = s[n] * q, q in -127..127 (`_weight_int8pack_mm`).
- int4: groups of 32 inputs, asymmetric, as GGUF's Q4_1: w = d * q + m, q in 0..15, quantized
  here from the loaded weights.
- gguf: the checkpoint's own Q4_0/Q4_1 blocks, codes and scales as stored. A Q4 block maps onto
  `_weight_int4pack_mm_for_cpu` exactly: its groups of 32 compute (q - 8) * scale + zero, so
  scale = d and zero = m + 8 d.

The LM head is int8 per channel in every mode (a GGUF's is usually Q8_0, whose 32-value block
scales have no packed kernel; per-channel int8 is the closest that has one). The embedding and
the norms stay float. A decode step reads each weight once, so fewer bytes should mean less
time; BENCHMARKS.md has what it measured.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import ConfigError
from engine.loading import gguf_blocks
from engine.loading.gguf_blocks import BLOCK, Q4Blocks
from parallel.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

INT4_ROWS = 16  # the int4 packing takes output widths in multiples of this
# Products of more rows than this dequantize the weight and run the float matmul: torch's
# weight-only kernels have no blocked path for float32 activations, and a 256-row float32
# product ran ~70x (int8) and ~200x (int4) slower than the float matmul (2 threads, Xeon with
# AMX, under load); at a few rows they read fewer bytes and win. See BENCHMARKS.md.
KERNEL_ROWS = 4


@dataclass(slots=True)
class QuantizedWeight:
    """Stands where a projection's float weight [N, K] was (engine.rank.gemm routes it here).
    int8: codes [N, K] int8, scales [N]. int4: codes packed [N, K/2] uint8 in the kernel's
    layout, scales [K/32, N, 2] (scale, zero) per group; and, for the engine's own kernel
    (engine.rank.quantized_rows) and to dequantize from, `nibbles` [N, K/2] uint8, the same
    codes in GGUF's Q4 block layout (a group's 16 bytes hold its code i in the low nibble of
    byte i and code i + 16 in the high one), and `steps` [2, N, K/32, 1]: each group's d and
    m (w = d q + m)."""

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, int]
    nibbles: torch.Tensor | None = None
    steps: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """What a product through the kernel reads (the tracer's bytes): codes and scales."""
        return self.codes.nbytes + self.scales.nbytes

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the activations it multiplies (and of its scales)."""
        return self.scales.dtype

    def clone(self) -> "QuantizedWeight":
        """A copy in memory of its own (engine.rank.kernel_choice times streamed copies)."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).clone()
                                            for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor it holds."""
        return [t for t in (self.codes, self.scales, self.nibbles, self.steps) if t is not None]

    @property
    def stored_bytes(self) -> int:
        """The memory it takes, the block-layout copy of int4 codes included."""
        return sum(t.nbytes for t in self.tensors())

    def dequantized(self) -> torch.Tensor:
        """The float weight [N, K] the codes stand for, in the scales' dtype."""
        if self.kind == "int8":
            return self.codes.to(self.scales.dtype) * self.scales[:, None]
        n, k = self.shape
        # each group's low nibbles, then its high ones: stacked, which inductor compiles to
        # vector code (a shift by a broadcast [0, 4] compiled to scalar code, 7x slower)
        nibbles = self.nibbles.view(n, k // BLOCK, BLOCK // 2)
        codes = torch.stack([nibbles & 15, nibbles >> 4], dim=2)
        groups = codes.view(n, k // BLOCK, BLOCK).to(self.scales.dtype)
        return torch.addcmul(self.steps[1], groups, self.steps[0]).view(n, k)

    def __getitem__(self, rows: slice) -> "QuantizedWeight":
        """Output rows a:b (the scorer tiles the LM head this way): int8 only, whose rows are
        independent; int4 packs rows in blocks."""
        if self.kind != "int8" or not isinstance(rows, slice):
            raise TypeError(f"a {self.kind} weight slices by a range of rows (int8 only)")
        codes = self.codes[rows]
        return QuantizedWeight("int8", codes, self.scales[rows], (codes.shape[0], self.shape[1]))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x Wᵀ (+ b) for x [..., K] of the scales' dtype."""
        rows = x.reshape(-1, self.shape[1]).contiguous()
        if self.kind == "int8":
            y = torch._weight_int8pack_mm(rows, self.codes, self.scales)
        else:
            y = torch._weight_int4pack_mm_for_cpu(rows, self.codes, BLOCK, self.scales)
        y = y.reshape(*x.shape[:-1], self.shape[0])
        return y if bias is None else y + bias


def int8_per_channel(weight: torch.Tensor) -> QuantizedWeight:
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", codes, scales.to(weight.dtype), tuple(weight.shape))


def int4_groups(weight: torch.Tensor) -> QuantizedWeight:
    """Groups of 32 along K: d = (max - min) / 15, m = min, q = round((w - m) / d)."""
    w = weight.detach().float()
    n, k = w.shape
    groups = w.reshape(n, k // BLOCK, BLOCK)
    low, high = groups.amin(-1), groups.amax(-1)
    d = (high - low) / 15
    q = torch.round((groups - low[..., None]) / torch.where(d > 0, d, 1)[..., None])
    blocks = Q4Blocks(q.clamp(0, 15).to(torch.uint8).reshape(n, k), d, low)
    return from_q4_blocks(blocks, weight.dtype)


def from_q4_blocks(blocks: Q4Blocks, dtype: torch.dtype) -> QuantizedWeight:
    n, k = blocks.codes.shape
    packed = torch._convert_weight_to_int4pack_for_cpu(blocks.codes.to(torch.int32), 2)
    zeros = blocks.mins + 8 * blocks.scales
    scales = torch.stack([blocks.scales, zeros], dim=-1).transpose(0, 1).contiguous()
    halves = blocks.codes.to(torch.uint8).view(n, k // BLOCK, 2, BLOCK // 2)
    nibbles = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)
    steps = torch.stack([blocks.scales, blocks.mins])[..., None].to(dtype)
    return QuantizedWeight("int4", packed, scales.to(dtype), (n, k), nibbles, steps)


def check_int4_shapes(plan) -> None:
    """weights 'int4'/'gguf': every rank's projections [N, K] must suit the int4 kernel; the
    driver checks them from the plan (an EnginePlan) before any rank starts."""
    mc, d = plan.model, plan.model.hidden_size
    for rank in range(plan.world_size):
        shard = plan.shard(rank)
        q, kv = shard.heads.num_q_heads * mc.head_dim, shard.heads.num_kv_heads * mc.head_dim
        ffn = shard.ffn[1] - shard.ffn[0]
        shapes = {"qkv_proj": (q + 2 * kv, d), "o_proj": (d, q), "gate_up_proj": (2 * ffn, d),
                  "down_proj": (d, ffn)}
        for name, (n, k) in shapes.items():
            if k % BLOCK or n % INT4_ROWS:
                raise ConfigError(
                    f"weights={plan.weights!r}: rank {rank}'s {name} is [{n}, {k}]; the int4 "
                    f"kernel needs inputs in multiples of {BLOCK} and outputs in multiples of "
                    f"{INT4_ROWS}; use weights='int8' or another tp")


def quantize_model(model: nn.Module, kind: str, ckpt=None) -> int:
    """Replace every projection's float weight by a QuantizedWeight, in place; the bytes they
    take. kind 'gguf' reads the codes from `ckpt` (a GGUFCheckpoint) at the slices each
    layer's weight was loaded from (`weight_reads`)."""
    nbytes = 0
    for module in model.modules():
        if isinstance(module, ParallelLMHead):
            quantized = int8_per_channel(module.weight)
        elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            quantized = _projection(module, kind, ckpt)
        else:
            continue
        del module.weight  # the float Parameter goes (a tied LM head's stays the embedding's)
        module.weight = quantized
        nbytes += quantized.stored_bytes
    return nbytes


def quantized_weights(model: nn.Module) -> list[QuantizedWeight]:
    """Every weight quantize_model put in place."""
    return [m.weight for m in model.modules() if isinstance(getattr(m, "weight", None),
                                                            QuantizedWeight)]


def _projection(module: nn.Module, kind: str, ckpt) -> QuantizedWeight:
    if kind == "int8":
        return int8_per_channel(module.weight)
    if kind == "int4":
        return int4_groups(module.weight)
    blocks = gguf_blocks.concat_rows([ckpt.read_q4(*read) for read in module.weight_reads])
    return from_q4_blocks(blocks, module.weight.dtype)
