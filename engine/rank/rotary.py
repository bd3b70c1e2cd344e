"""Rotary position embedding in the rotate-half layout of the HF Llama/Qwen2 models."""
from __future__ import annotations

import math

import torch

from engine.loading.model_config import ModelConfig
from engine.rank import ops
from engine.rank.backend import TORCH, Backend


def _llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths slowed by `factor`, short ones
    kept, a smooth blend between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(mid, blended, out)


class RotaryEmbedding(torch.nn.Module):
    """Rotates q and k by their positions. cos/sin tables [max_positions, head_dim/2] stay
    float32 whatever the model dtype; one instance is shared by every layer."""

    def __init__(self, cfg: ModelConfig, max_positions: int, backend: Backend = TORCH):
        super().__init__()
        self.backend = backend
        d = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        if cfg.rope_scaling is not None:
            inv_freq = _llama3_scaled(inv_freq, cfg.rope_scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        # (positions, multipliers) of the last eager step: its later layers reuse them
        self._step_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rotate = self.backend.rotate
        if rotate is None or torch.compiler.is_compiling():  # a graph gathers in its loop
            return self.backend.rope(positions, q, k, self.cos, self.sin)
        # one step's layers get the one positions tensor of its context; the reference kept
        # here keeps that object alive, so `is` cannot match a later step's tensor
        rows = self._step_rows
        if rows is None or rows[0] is not positions:
            rows = self._step_rows = (positions, *ops.rope_rows(positions, self.cos, self.sin))
        return rotate(q, k, rows[1], rows[2])
