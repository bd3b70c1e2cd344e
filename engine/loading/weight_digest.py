"""A digest of every weight a model loaded, which any changed weight changes and which comes
out the same for every TP split (a handle's K/V are checked against it across engines).

Each rank digests what it reads while it loads, one short SHA-256 per *unit* of each slice: a
row of a slice along dim 0, a column of one along dim 1, the whole tensor when it is read whole.
A unit is the same whichever ranks split the tensor, so the driver lays every rank's unit
digests out by their global index (a slice two ranks both loaded, a replicated KV head or a
norm, lands on the same places with the same digests) and digests the whole layout once.
"""
from __future__ import annotations

import hashlib
import time

import torch

_UNIT_BYTES = 8  # of each unit's SHA-256: 2**64 values tell any two versions of one row apart

# tensor name -> (dim, first global unit index, the units' digests concatenated), per slice read
Slices = dict[str, list[tuple[int | None, int, bytes]]]


class WeightDigest:
    """On a rank: the unit digests of every slice it loaded."""

    def __init__(self) -> None:
        self.slices: Slices = {}
        self.seconds = 0.0  # spent digesting, for RankInfo

    def add(self, name: str, dim: int | None, start: int, tensor: torch.Tensor) -> None:
        if tensor.numel() == 0:  # a rank holding none of this tensor
            return
        started = time.perf_counter()
        units = (tensor.reshape(1, -1) if dim is None
                 else tensor.movedim(dim, 0).reshape(tensor.shape[dim], -1))
        rows = units.contiguous().view(torch.uint8).numpy()  # the stored bytes, bf16 included
        digests = b"".join(hashlib.sha256(row).digest()[:_UNIT_BYTES] for row in rows)
        self.slices.setdefault(name, []).append((dim, 0 if dim is None else start, digests))
        self.seconds += time.perf_counter() - started


def combine(per_rank: list[Slices]) -> str:
    """One hex digest of the whole model from every rank's slices (any TP, any overlap)."""
    laid: dict[tuple[str, int | None], dict[int, bytes]] = {}
    for slices in per_rank:
        for name, parts in slices.items():
            for dim, start, digests in parts:
                units = laid.setdefault((name, dim), {})
                for i in range(0, len(digests), _UNIT_BYTES):
                    units[start + i // _UNIT_BYTES] = digests[i:i + _UNIT_BYTES]
    whole = hashlib.sha256()
    for (name, dim), units in sorted(laid.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        whole.update(f"{name}|{dim}|{len(units)}|".encode())
        whole.update(b"".join(i.to_bytes(8, "little") + units[i] for i in sorted(units)))
    return whole.hexdigest()[:24]
