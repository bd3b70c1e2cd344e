"""How K/V move between ranks of two engines: a small interface, one implementation per device.

Wire layout: one unit per (layer, global KV head): the K and V of every prompt position,
[2, tokens, head_dim]. A source rank publishes the units of its own heads; a destination rank
fetches only the units of the heads it owns, from whichever source rank holds each, and scatters
them into its own blocks. That is what makes any source TP meet any destination TP (including
heads replicated past the KV-head count): the unit is the head, not the rank's slice.

Implementations:
- `RayObjectStoreTransport` (CPU; built): each source rank `ray.put`s its units; the refs travel
  in the handle; each destination rank `ray.get`s its own. Objects are owned by the source rank's
  process, so the bytes go source rank -> object store -> destination rank, never via a driver.
  A source rank that dies takes its objects with it: the pull fails with a clear error.
- CUDA `torch.distributed` point-to-point (not built): `publish` would return block ids instead of
  copies (the source's blocks are pinned for exactly this); `fetch` would be one NCCL send/recv
  per (layer, head) between a process group spanning both engines' ranks, posted by both drivers
  for the same handle, layer by layer so a layer's attention can start while the next arrives.
- NIXL/UCX (not built; the same seam): `publish` registers the cache tensor's memory once and
  returns (block ids, remote memory descriptor); `fetch` issues one-sided RDMA reads of the owned
  heads' strided slices straight into the destination blocks, with no source-side work at all.
"""
from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from typing import Any

import torch

from engine.rank.kv_cache import KVCache
from parallel.partition import Range


class KVTransport(ABC):
    name: str

    @abstractmethod
    def publish(self, cache: KVCache, block_table: list[int], length: int) -> list[list[Any]]:
        """On a source rank: make this rank's K/V of one sequence fetchable; refs[layer][local
        kv head]."""

    @abstractmethod
    def fetch(self, cache: KVCache, kv_heads: Range, refs: dict[int, list[Any]],
              block_table: list[int], length: int, timeout_s: float) -> None:
        """On a destination rank: for each global head in kv_heads, refs[head][layer] locate its
        unit; write them all into block_table's first `length` slots. Raises on any failure."""

    @abstractmethod
    def discard(self, refs: list) -> None:
        """Let go of published units (the handle was consumed, released or expired)."""


class RayObjectStoreTransport(KVTransport):
    name = "ray-object-store"

    def publish(self, cache: KVCache, block_table: list[int], length: int) -> list[list[Any]]:
        import ray

        refs = []
        for layer in range(cache.data.shape[1]):
            k, v = cache.gather(layer, block_table, length)  # [T, heads, d]
            kv = torch.stack([k, v]).cpu()  # [2, T, heads, d]
            # raw bytes: numpy arrays in the object store are read back without a copy, and
            # every dtype (bf16 too) survives as uint8
            refs.append([ray.put(kv[:, :, h].contiguous().view(torch.uint8).numpy())
                         for h in range(kv.shape[2])])
        return refs

    def fetch(self, cache: KVCache, kv_heads: Range, refs: dict[int, list[Any]],
              block_table: list[int], length: int, timeout_s: float) -> None:
        import ray

        _, layers, _, bs, heads, d = cache.data.shape
        dtype = cache.data.dtype
        slots = torch.tensor([block_table[p // bs] * bs + p % bs for p in range(length)],
                             device=cache.data.device)
        wanted = [refs[h] for h in range(*kv_heads)]
        every = [ref for per_head in wanted for ref in per_head]
        ray.wait(every, num_returns=len(every), timeout=0, fetch_local=True)  # start all pulls
        expect = (2, length, d * dtype.itemsize)
        for layer in range(layers):  # layer by layer: one layer's bytes in flight at a time
            arrays = ray.get([per_head[layer] for per_head in wanted], timeout=timeout_s)
            for array in arrays:
                if tuple(array.shape) != expect:
                    raise ValueError(f"a K/V unit of shape {tuple(array.shape)}, expected {expect}")
            with warnings.catch_warnings():  # read-only views of the object store: only read
                warnings.simplefilter("ignore", UserWarning)
                units = [torch.from_numpy(a).view(dtype) for a in arrays]  # each [2, T, d]
            kv = torch.stack(units, dim=2).to(cache.data.device)  # [2, T, heads, d]
            cache.data[:, layer].view(2, -1, heads, d)[:, slots] = kv

    def discard(self, refs: list) -> None:
        refs.clear()  # the objects go once no handle copy refers to them either


def transport_for(device: str) -> KVTransport:
    """The transport every rank of an engine uses; CUDA ranks use the object store too until
    the NCCL transport exists (correct, just a host round trip)."""
    return RayObjectStoreTransport()
