"""The source side: K/V a prefill engine has handed out, and when their blocks come back.

A prefill with `export_kv=True` finishes with its blocks still referenced (the scheduler hands
the sequence's references over instead of freeing them). Here each such sequence becomes a
`KVHandle`: every rank publishes its heads, the lease table starts the handle's time to live, and
the blocks stay pinned until the lease is used (a decode adopted it), released, or expires.
Pinned blocks are reclaimed lazily, whenever this engine next takes a request, a `release()` or a
`cache_stats()`: the lease table is asked which leases ended.
"""
from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass

from engine.driver.engine_core import EngineCore
from engine.driver.replica import Replica
from engine.driver.sequence import FinishReason, Sequence
from engine.errors import InvalidRequestError
from engine.transfer.handle import KVHandle, KVTransferError, ModelFingerprint, SourceRank
from engine.transfer.transport import export_kv

_LEASE_TIMEOUT_S = 30.0


@dataclass(slots=True)
class _Export:
    replica: Replica  # identity: a restart builds new replicas, and these blocks went with it
    block_table: list[int]


def is_pinned(seq: Sequence) -> bool:
    """Whether the scheduler left this finished sequence's blocks referenced for export."""
    return seq.pin_kv and seq.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


class ExportTable:
    def __init__(self, core: EngineCore, ttl_s: float, ray_address: str | None):
        self._core, self._ttl_s, self._address = core, ttl_s, ray_address
        self._records: dict[str, _Export] = {}
        self._leases = None  # started with the first export
        self._starting = threading.Lock()  # two first exports at once must start one table

    def export(self, seqs: list[Sequence], fingerprint: ModelFingerprint) -> list[KVHandle]:
        """Handles for finished, pinned sequences (their blocks are unpinned if this fails)."""
        from parallel.ray import cluster
        from parallel.ray.leases import start_lease_table

        try:
            cluster.connect(self._address)  # an in-process rank publishes into the object store too
            with self._starting:
                if self._leases is None:
                    self._leases = start_lease_table()
            return self._core.call(lambda: [self._publish(s, fingerprint) for s in seqs])
        except BaseException:
            self.unpin(seqs)  # handles made before the failure expire with their TTL
            raise

    def _publish(self, seq: Sequence, fp: ModelFingerprint) -> KVHandle:
        import ray

        replica, table = seq.replica, seq.kv_block_table
        if not self._core.serves(replica):  # rebuilt or restarted since: the K/V went with it
            raise KVTransferError(f"the replica that prefilled this prompt was replaced before "
                                  f"its K/V could be exported; prefill it again")
        actors = replica.rank_actors()
        if actors is not None:  # destination ranks ask these actors for the pinned blocks
            ranks = tuple(SourceRank(info.kv_heads, actor, tuple(table))
                          for info, actor in zip(replica.rank_info, actors))
        else:  # a rank in this process: no actor to ask, so it publishes now
            per_rank = replica.run_on_ranks(export_kv, [(table, seq.num_prompt_tokens)])
            ranks = tuple(SourceRank(info.kv_heads, refs=tuple(tuple(layer) for layer in refs[0]))
                          for info, refs in zip(replica.rank_info, per_rank))
        handle_id = uuid.uuid4().hex
        ray.get(self._leases.add.remote(handle_id, self._ttl_s), timeout=_LEASE_TIMEOUT_S)
        self._records[handle_id] = _Export(replica, table)
        seq.pin_kv = False  # the export owns the blocks now
        return KVHandle(handle_id, fp, tuple(seq.prompt_token_ids), seq.output_token_ids[0],
                        len(ranks), ranks, self._leases, self._ttl_s)

    def unpin(self, seqs: list[Sequence]) -> None:
        """Give back the blocks of pinned sequences no handle was made for."""
        pinned = [s for s in seqs if is_pinned(s)]
        for s in pinned:
            s.pin_kv = False
        if pinned:
            try:
                self._core.call(lambda: [self._free(s.replica, s.kv_block_table) for s in pinned])
            except InvalidRequestError:  # shut down: the blocks went with the engine
                pass

    def _free(self, replica: Replica, table: list[int]) -> None:
        if self._core.serves(replica):  # else replaced: those blocks are gone anyway
            replica.unpin_kv(table)

    def release(self, handle: KVHandle) -> None:
        if not isinstance(handle, KVHandle):  # a PrefillOutput's repr would print its logits
            raise InvalidRequestError(f"release() takes a KVHandle (PrefillOutput.kv of a "
                                      f"prefill with export_kv=True), got {type(handle).__name__}")
        if handle.handle_id not in self._records:
            raise InvalidRequestError(f"{handle!r} was not exported by this engine, or its blocks "
                                      f"were already reclaimed (used, released or expired)")
        import ray

        why = ray.get(handle.lease.release.remote(handle.handle_id), timeout=_LEASE_TIMEOUT_S)
        if why == "claimed":
            raise InvalidRequestError(f"{handle!r} is being decoded right now; release it after")
        self.sync()

    def sync(self) -> None:
        """Unpin the blocks of every handle whose lease ended."""
        if not self._records or self._leases is None:
            return
        import ray
        from ray.exceptions import RayError

        try:
            done = ray.get(self._leases.collect.remote(), timeout=_LEASE_TIMEOUT_S)
        except RayError:  # the lease table is gone (Ray shut down): no handle can be claimed
            done = list(self._records)
        records = [self._records.pop(h) for h in done if h in self._records]
        if records:
            self._core.call(lambda: [self._free(r.replica, r.block_table) for r in records])

    def owns(self, handle: object) -> bool:
        return getattr(handle, "handle_id", None) in self._records

    @property
    def pinned_handles(self) -> int:
        return len(self._records)

    def describe_pinned(self, own: int) -> str:
        """Who pins blocks here and how to free them, for a refused export's message; `own`:
        the refused call's prompts pinned before it."""
        ids = [h[:8] for h in self._records]  # as KVHandle's repr shows them
        why = []
        if ids:
            named = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
            why.append(f"{len(ids)} exported handle(s) pin blocks here ({named}): decode them on "
                       f"another engine, release them with LLM.release(kv), or let their "
                       f"kv_handle_ttl_s={self._ttl_s:g} s pass")
        if own:
            why.append(f"{own} earlier prompt(s) of this call took pins: export fewer at once")
        if not why:
            return ("Nothing else pins blocks here: a cache of one max_model_len request can keep "
                    "no K/V pinned; raise kv_cache_gb or lower max_model_len")
        return "; ".join(why) + "; or raise kv_cache_gb"

    def close(self) -> None:
        """The engine is going away or restarting: its handles can no longer be claimed (their
        objects went with the ranks that owned them)."""
        leases, self._leases = self._leases, None
        self._records.clear()
        if leases is not None:
            import ray

            if ray.is_initialized():
                ray.kill(leases, no_restart=True)
