"""How K/V move between ranks of two engines: a small interface, one implementation per device.

The unit is one KV head of one layer: the K and V of every prompt position, [2, tokens,
head_dim]. A destination rank fetches only the heads it owns, each from one source rank that
holds it, and scatters them into its own blocks. That is what makes any source TP meet any
destination TP (heads replicated past the KV-head count included): the unit is the head, not the
rank's slice.

Built (CPU), over Ray:
- A source rank that is a Ray actor publishes nothing: its blocks stay pinned, the handle names
  the actor and the block table, and each destination rank asks that actor for its heads, a few
  layers per call, all calls in flight at once (the source reads layer chunk i+1 while the
  destination writes chunk i). The bytes go source rank -> object store -> destination rank;
  the reply is owned by the destination and freed once written, so nothing outlives the pull.
- A rank in the driver's process (tp=1, executor=auto) has no actor to ask: it `ray.put`s its
  heads when the prefill ends (the driver is that rank, so nothing extra crosses the driver),
  and destination ranks `ray.get` them. Those objects live while a copy of the handle does.

Not built, same seam: CUDA `torch.distributed` point-to-point (both drivers post one NCCL
send/recv per (layer chunk, head) on a process group spanning both engines' ranks, reading the
pinned blocks in place), and NIXL/UCX (the source registers its cache tensor once and publishes
(block ids, remote memory descriptor); destination ranks issue one-sided RDMA reads of their
heads' strided slices straight into their blocks, with no source-side work per request).
"""
from __future__ import annotations

import time
import warnings
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from engine.rank.kv_cache import KVCache
from parallel.partition import Range

if TYPE_CHECKING:
    from engine.rank.worker import Worker

LAYER_CHUNKS = 4  # pulls per source rank per request: enough to overlap, few enough calls


def read_heads(cache: KVCache, block_table: list[int], length: int, heads: list[int],
               layers: Range) -> Any:
    """This rank's K/V of `heads` (local indices) for `layers`, as uint8 bytes of a
    [layers, 2, length, heads, d] tensor: numpy crosses Ray without a copy, and every dtype
    (bf16 too) survives as bytes."""
    out = []
    for layer in range(*layers):
        k, v = cache.gather(layer, block_table, length)  # [T, local heads, d]
        out.append(torch.stack([k[:, heads], v[:, heads]]))
    return torch.stack(out).cpu().contiguous().view(torch.uint8).numpy()


class KVTransport(ABC):
    @abstractmethod
    def publish(self, cache: KVCache, block_table: list[int], length: int) -> list[list[Any]]:
        """On a source rank with no actor: make its K/V fetchable; refs[layer][local kv head]."""

    @abstractmethod
    def fetch(self, cache: KVCache, kv_heads: Range, sources: tuple, owners: dict[int, tuple[int, int]],
              block_table: list[int], length: int, timeout_s: float) -> None:
        """On a destination rank: write the heads in `kv_heads` (global) of every layer into
        block_table's first `length` slots; owners[head] = (source rank, its local index).
        Raises on any failure (the caller frees the blocks)."""


class RayTransport(KVTransport):
    def publish(self, cache: KVCache, block_table: list[int], length: int) -> list[list[Any]]:
        import ray

        heads = list(range(cache.data.shape[4]))
        return [[ray.put(read_heads(cache, block_table, length, [h], (layer, layer + 1)))
                 for h in heads] for layer in range(cache.data.shape[1])]

    def fetch(self, cache: KVCache, kv_heads: Range, sources: tuple, owners: dict[int, tuple[int, int]],
              block_table: list[int], length: int, timeout_s: float) -> None:
        bs, deadline = cache.block_size, time.monotonic() + timeout_s  # one bound for the whole pull
        slots = torch.tensor([block_table[p // bs] * bs + p % bs for p in range(length)],
                             device=cache.data.device)
        by_source: dict[int, list[tuple[int, int]]] = {}  # source rank -> (my index, its index)
        for mine, head in enumerate(range(*kv_heads)):
            src, theirs = owners[head]
            by_source.setdefault(src, []).append((mine, theirs))
        for src, pairs in by_source.items():
            pull = self._from_actor if sources[src].actor is not None else self._from_objects
            for layers, kv in pull(sources[src], [t for _, t in pairs], length, cache, deadline):
                mine = torch.tensor([m for m, _ in pairs], device=cache.data.device)
                for i, layer in enumerate(range(*layers)):  # kv: [layers, 2, T, heads, d]
                    view = cache.data[:, layer].view(2, -1, *cache.data.shape[4:])
                    view[:, slots[:, None], mine[None, :]] = kv[i].to(cache.data.device)

    @staticmethod
    def _from_actor(source, heads: list[int], length: int, cache: KVCache, deadline: float):
        import ray

        layers = cache.data.shape[1]
        step = -(-layers // LAYER_CHUNKS)
        chunks = [(a, min(a + step, layers)) for a in range(0, layers, step)]
        # beside the source's own steps: a busy prefill engine must not hold up the pull (the
        # destination's decode loop waits on it); pinned blocks are never written by a step
        refs = [source.actor.run_beside.remote(read_kv_heads, list(source.block_table), length,
                                               heads, c) for c in chunks]
        for chunk, ref in zip(chunks, refs):
            yield chunk, _as_tensor(ray.get(ref, timeout=_left(deadline)),
                                    (chunk[1] - chunk[0], 2, length, len(heads)), cache)

    @staticmethod
    def _from_objects(source, heads: list[int], length: int, cache: KVCache, deadline: float):
        import ray

        every = [source.refs[layer][h] for layer in range(cache.data.shape[1]) for h in heads]
        ray.wait(every, num_returns=len(every), timeout=0, fetch_local=True)  # start every pull
        for layer in range(cache.data.shape[1]):
            arrays = ray.get([source.refs[layer][h] for h in heads], timeout=_left(deadline))
            units = [_as_tensor(a, (1, 2, length, 1), cache) for a in arrays]
            yield (layer, layer + 1), torch.cat(units, dim=3)


def _left(deadline: float) -> float:
    return max(0.01, deadline - time.monotonic())


def _as_tensor(array: Any, shape: tuple[int, ...], cache: KVCache) -> torch.Tensor:
    """Bytes from the wire back to K/V, checked: a unit of the wrong size is refused."""
    dtype, d = cache.data.dtype, cache.data.shape[5]
    expect = (*shape, d * dtype.itemsize)
    if tuple(array.shape) != expect:
        raise ValueError(f"a K/V unit of shape {tuple(array.shape)}, expected {expect}")
    with warnings.catch_warnings():  # a read-only view of the object store: only read from
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array).view(dtype)


def transport_for(device: str) -> KVTransport:
    """The transport an engine's ranks use. CUDA ranks use it too until the NCCL transport
    exists (correct, with a host round trip)."""
    return RayTransport()


# What a rank runs for a hand-off: `Replica.run_on_ranks(fn, ...)` or a source actor's
# `run_beside(fn, ...)` calls `fn(worker, ...)` on the rank; module-level, so they travel by
# reference, and the rank itself knows nothing of transfers.

def export_kv(worker: Worker, items: list[tuple[list[int], int]]) -> list[list]:
    """Publish this rank's K/V of each (block table, length) into the object store (a rank
    without an actor, which another engine's ranks cannot call)."""
    transport = transport_for(worker.plan.device)
    return [transport.publish(worker.cache, table, length) for table, length in items]


def read_kv_heads(worker: Worker, block_table: list[int], length: int, heads: list[int],
                  layers: Range) -> Any:
    """Another engine's rank pulling some of this rank's heads of a pinned sequence."""
    return read_heads(worker.cache, block_table, length, heads, layers)


def import_kv(worker: Worker, items: list[tuple], timeout_s: float) -> list[str | None]:
    """Pull the heads this rank owns of each handed-off sequence (sources, owners, block
    table, length) into its blocks. Never raises: a failure is reported per item, so the
    driver decides for the whole group."""
    transport, errors = transport_for(worker.plan.device), []
    for sources, owners, table, length in items:
        try:
            transport.fetch(worker.cache, worker.shard.heads.kv_heads, sources, owners, table,
                            length, timeout_s)
            errors.append(None)
        except Exception as e:  # noqa: BLE001  reported to the driver, which frees the blocks
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    return errors
