"""A GGUF's 4-bit blocks read as they are stored: codes and per-block scales, never widened
to float32 values (weights="gguf").

Q4_0 and Q4_1 store 32 weights per block: a float16 scale d (Q4_1: and a float16 minimum m)
then 16 bytes of 4-bit codes q, low nibbles first (code j, then code j + 16 in the high
nibble). The weight is d * q + m (Q4_1) or d * (q - 8) (Q4_0, i.e. m = -8 d).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

from engine.errors import ConfigError

BLOCK = 32  # weights per block, along a row (the input dimension)
# type name -> bytes per block and whether a float16 minimum follows the scale
_LAYOUTS = {"Q4_0": (18, False), "Q4_1": (20, True)}
_PROJECTION = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")


@dataclass(slots=True)
class Q4Blocks:
    """Rows of a 4-bit tensor: w[r, c] = scales[r, c // 32] * codes[r, c] + mins[r, c // 32]."""

    codes: torch.Tensor  # [rows, cols] uint8 in 0..15
    scales: torch.Tensor  # [rows, cols / 32] float32 (float16 values, exactly)
    mins: torch.Tensor  # [rows, cols / 32] float32


def unpack(data: np.ndarray, type_name: str) -> Q4Blocks:
    """`data`: [rows, bytes per row] of a Q4_0 or Q4_1 tensor, as the GGUF file maps it
    (engine.loading.gguf_file)."""
    size, has_min = _LAYOUTS[type_name]
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, size)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 4:] if has_min else blocks[..., 2:]
    mins = (blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if has_min
            else -8 * scales)
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)
    return Q4Blocks(torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(mins))


def take_columns(blocks: Q4Blocks, start: int, stop: int, name: str) -> Q4Blocks:
    """Columns start:stop of every row; they must cover whole blocks."""
    if start % BLOCK or stop % BLOCK:
        raise ConfigError(f"weights='gguf': this rank's columns {start}:{stop} of {name} cut "
                          f"through its 32-value blocks; use a tp that splits the input on "
                          f"multiples of 32, or weights='int8'")
    a, b = start // BLOCK, stop // BLOCK
    return Q4Blocks(blocks.codes[:, start:stop], blocks.scales[:, a:b], blocks.mins[:, a:b])


def concat_rows(parts: list[Q4Blocks]) -> Q4Blocks:
    return Q4Blocks(*(torch.cat([getattr(p, f) for p in parts])
                      for f in ("codes", "scales", "mins")))


def require_q4_projections(ckpt) -> None:
    """weights='gguf' runs the file's projection tensors as stored: each must be Q4_0 or
    Q4_1 (norms, embedding and LM head may be of any type: they are read as float32)."""
    types = getattr(ckpt, "tensor_types", None)
    if types is None:
        raise ConfigError(f"weights='gguf' needs a .gguf checkpoint, and {ckpt.source} is not "
                          f"one; use weights='int8' or 'int4' (quantized as it loads)")
    for name, kind in sorted(types().items()):
        if _PROJECTION.search(name) and kind not in _LAYOUTS:
            raise ConfigError(f"weights='gguf' runs Q4_0 and Q4_1 projections as stored, and "
                              f"{ckpt.source} holds {name} as {kind}; use weights='int8' or "
                              f"'int4' (requantized from its values) or weights=None")
