"""Filling a built model with its checkpoint's tensors: each slice read once, cast once on its
way to the device, checked, and digested (weight_digest)."""
from __future__ import annotations

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.loading.checkpoint import Checkpoint
from engine.loading.weight_digest import WeightDigest


def load_weights(model: nn.Module, ckpt: Checkpoint, device: torch.device,
                 dtype: torch.dtype) -> WeightDigest:
    """Every tensor `model.load` asks for, each exactly as expected, and no tensor of the
    checkpoint left over; the digest of every slice read."""
    # parameters go to their device and dtype before loading, so each checkpoint slice is
    # cast once on its way in; the rotary tables (buffers) stay float32
    for p in model.parameters():
        p.data = torch.empty_like(p.data, device=device, dtype=dtype)
    model.to(device)
    used: set[str] = set()
    digest = WeightDigest()

    def read(name, dim, start, stop):
        used.add(name)
        tensor = ckpt.read(name, dim, start, stop)
        if not torch.isfinite(tensor).all():
            raise ModelLoadError(f"{ckpt.source}: tensor {name} holds NaN or Inf values; "
                                 f"the checkpoint is corrupt")
        digest.add(name, dim, start, tensor)
        return tensor

    try:
        model.load(read)
    except ValueError as e:
        raise ModelLoadError(f"{ckpt.source}: {e}") from None
    extra = sorted(ckpt.names() - used)
    if extra:
        raise ModelLoadError(f"{ckpt.source}: {len(extra)} tensor(s) this architecture does not "
                             f"use, e.g. {extra[:3]}; is config.json for another model?")
    return digest
