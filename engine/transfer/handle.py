"""`KVHandle`: what a prefill engine hands out for one request's K/V, and the checks a decode
engine runs on one before it touches its own cache.

A handle is small and picklable: the K/V themselves stay with the source ranks (in Ray's object
store, one object per layer and KV head); the handle holds references to them, the source's head
layout, the prompt and its first token, and the lease that says whether it may still be used.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from engine.errors import EngineError, InvalidRequestError
from engine.loading.model_config import ModelConfig
from parallel.partition import Range


class KVTransferError(EngineError):
    """A hand-off failed (source gone, K/V lost, transfer error). Nothing was written to the
    destination's cache; the handle can be retried or released."""


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """What must match for K/V of one engine to mean the same thing in another."""

    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    weights: str  # digest of every weight loaded (weight_digest.py): a fine-tune differs here
    dtype: str
    block_size: int


@dataclass(frozen=True, slots=True)
class SourceRank:
    """One source rank's share: its global KV heads, and where to pull them from: its actor and
    the pinned block table (a rank in a Ray actor), or refs[layer][local kv head] to objects it
    put (a rank in its driver's process). See engine/transfer/transport.py."""

    kv_heads: Range
    actor: Any = None
    block_table: tuple[int, ...] = ()
    refs: tuple[tuple[Any, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class KVHandle:
    handle_id: str
    fingerprint: ModelFingerprint
    prompt_token_ids: tuple[int, ...]
    first_token: int
    source_tp: int
    ranks: tuple[SourceRank, ...]  # in source rank order
    lease: Any  # the source's lease table (a Ray actor): claim/settle/release by handle_id
    ttl_s: float

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def __repr__(self) -> str:
        return (f"KVHandle({self.handle_id[:8]}, {self.num_tokens} tokens, first_token="
                f"{self.first_token}, source tp={self.source_tp}, {self.fingerprint.dtype})")


def model_fingerprint(mc: ModelConfig, weights: str, dtype: torch.dtype,
                      block_size: int) -> ModelFingerprint:
    """`weights`: the digest the ranks computed as they loaded (weight_digest.combine)."""
    return ModelFingerprint(mc.architecture, mc.num_layers, mc.num_heads, mc.num_kv_heads,
                            mc.head_dim, mc.hidden_size, mc.vocab_size, weights,
                            str(dtype).removeprefix("torch."), block_size)


def check_handle(handle: object, mine: ModelFingerprint) -> KVHandle:
    """The handle, if this engine can adopt it; else an InvalidRequestError naming what differs."""
    if not isinstance(handle, KVHandle):
        raise InvalidRequestError(f"decode() takes KVHandles (PrefillOutput.kv of a prefill with "
                                  f"export_kv=True), got {type(handle).__name__}")
    theirs = handle.fingerprint
    if not isinstance(theirs, ModelFingerprint):
        raise InvalidRequestError(f"{handle!r} is corrupted: no model fingerprint")
    if theirs.dtype != mine.dtype:
        raise InvalidRequestError(f"{handle!r} holds {theirs.dtype} K/V but this engine runs "
                                  f"{mine.dtype}; create the decode engine with dtype='{theirs.dtype}'")
    if theirs.block_size != mine.block_size:
        raise InvalidRequestError(f"{handle!r} comes from an engine with block_size="
                                  f"{theirs.block_size}, this one has {mine.block_size}; use the "
                                  f"same block_size on both")
    diff = [f.name for f in fields(ModelFingerprint) if getattr(theirs, f.name) != getattr(mine, f.name)]
    if diff:
        what = ("same shapes, other weights: a fine-tune or another checkpoint"
                if diff == ["weights"] else
                ", ".join(f"{d}: {getattr(theirs, d)!r} vs {getattr(mine, d)!r}" for d in diff))
        raise InvalidRequestError(f"{handle!r} comes from another model ({what}); decode it on an "
                                  f"engine of the same checkpoint")
    _check_layout(handle, mine)
    return handle


def _check_layout(h: KVHandle, fp: ModelFingerprint) -> None:
    """A handle unpickled by hand may say anything: every index it holds is checked here, so a
    bad one fails before any block is allocated."""
    def bad(why: str) -> InvalidRequestError:
        return InvalidRequestError(f"{h!r} is corrupted: {why}; prefill the prompt again")

    ids = h.prompt_token_ids
    if not isinstance(h.handle_id, str) or not isinstance(ids, tuple) or not ids:
        raise bad("no handle id or prompt")
    if not all(isinstance(t, int) and 0 <= t < fp.vocab_size for t in (*ids, h.first_token)):
        raise bad(f"a token id outside the vocabulary of {fp.vocab_size}")
    if not isinstance(h.ranks, tuple) or len(h.ranks) != h.source_tp or h.source_tp < 1:
        raise bad(f"{len(h.ranks)} source ranks for source tp={h.source_tp}")
    covered: set[int] = set()
    blocks = -(-len(ids) // fp.block_size)
    for r, part in enumerate(h.ranks):
        if not isinstance(part, SourceRank):
            raise bad(f"source rank {r} is a {type(part).__name__}")
        lo, hi = part.kv_heads
        if not 0 <= lo < hi <= fp.num_kv_heads:
            raise bad(f"source rank {r} claims KV heads {part.kv_heads} of {fp.num_kv_heads}")
        if part.actor is not None:
            if len(part.block_table) != blocks or not all(
                    isinstance(b, int) and b >= 0 for b in part.block_table):
                raise bad(f"source rank {r} names {len(part.block_table)} blocks for "
                          f"{len(ids)} tokens ({blocks} expected)")
        elif len(part.refs) != fp.num_layers or any(len(layer) != hi - lo for layer in part.refs):
            raise bad(f"source rank {r} holds refs for the wrong number of layers or heads")
        covered.update(range(lo, hi))
    if covered != set(range(fp.num_kv_heads)):
        raise bad(f"the source ranks hold KV heads {sorted(covered)}, not all {fp.num_kv_heads}")


def head_owners(handle: KVHandle) -> dict[int, tuple[int, int]]:
    """Global KV head -> (source rank, local index) of the first source rank holding it (a
    head replicated on several source ranks is read from one)."""
    owners: dict[int, tuple[int, int]] = {}
    for r, part in enumerate(handle.ranks):
        for local, head in enumerate(range(*part.kv_heads)):
            owners.setdefault(head, (r, local))
    return owners
