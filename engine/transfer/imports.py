"""The destination side: adopt handed-off K/V and decode from them.

For a batch of handles: check each (model, dtype, block size, layout), claim its lease (so a
handle is used once), then on the step-loop thread allocate blocks, have every rank pull the
heads it owns, and enter each sequence as running with its prompt computed and its first token
sampled. Any failure frees every block this call took and hands every lease back: nothing is
half-written (blocks are registered in the prefix cache only after a decode step) and both
engines stay usable.
"""
from __future__ import annotations

import time

from engine.driver.engine_core import SHUT_DOWN, EngineCore
from engine.driver.replica import Replica
from engine.driver.sampling_params import SamplingParams
from engine.driver.sequence import Sequence
from engine.errors import InvalidRequestError
from engine.plan import EnginePlan
from engine.transfer.handle import (KVHandle, KVTransferError, ModelFingerprint, check_handle,
                                    head_owners)
from engine.transfer.transport import import_kv

_LEASE_TIMEOUT_S = 30.0


def adopt(core: EngineCore, plan: EnginePlan, fp: ModelFingerprint, handles: list,
          params: SamplingParams, timeout_s: float) -> list[Sequence]:
    """Running sequences for the handles, their K/V in this engine's cache."""
    handles = [check_handle(h, fp) for h in handles]
    ids = [h.handle_id for h in handles]
    if len(set(ids)) != len(ids):
        raise InvalidRequestError("the same KVHandle appears twice; each can be decoded once")
    for h in handles:
        if h.num_tokens > plan.max_model_len:
            raise InvalidRequestError(
                f"{h!r} holds {h.num_tokens} tokens, past this engine's max_model_len="
                f"{plan.max_model_len}; decode it on an engine with max_model_len >= "
                f"{h.num_tokens}, or release it on its source (it stays pinned there until then)")
    claimed: list[KVHandle] = []
    try:
        for h in handles:
            _claim(h)
            claimed.append(h)
        seqs = core.call(lambda: _adopt_all(core.live_replicas(), handles, params,
                                            plan.max_model_len, timeout_s))
    except BaseException:
        _settle(claimed, used=False)
        raise
    _settle(claimed, used=True)
    return seqs


def _claim(h: KVHandle) -> None:
    import ray
    from ray.exceptions import RayError

    try:
        why = ray.get(h.lease.claim.remote(h.handle_id), timeout=_LEASE_TIMEOUT_S)
    except (RayError, AttributeError) as e:
        raise KVTransferError(f"{h!r}: its source engine was shut down or restarted ({type(e).__name__}); "
                              f"its K/V are gone, prefill the prompt again") from None
    if why is not None:
        raise InvalidRequestError(f"{h!r} cannot be decoded: it was already {why}; each handle is "
                                  f"decoded once, within kv_handle_ttl_s={h.ttl_s} s of its prefill")


def _settle(handles: list[KVHandle], used: bool) -> None:
    import ray
    from ray.exceptions import RayError

    try:
        ray.get([h.lease.settle.remote(h.handle_id, used) for h in handles],
                timeout=_LEASE_TIMEOUT_S)
    except RayError:  # the source is gone: nothing is left to give back to
        pass


def _adopt_all(replicas: list[Replica], handles: list[KVHandle], params: SamplingParams,
               max_model_len: int, timeout_s: float) -> list[Sequence]:
    """On the loop thread: allocate, pull, register. All or nothing."""
    if not replicas:
        raise InvalidRequestError(SHUT_DOWN)
    taken: list[tuple[Replica, list[int]]] = []
    placed = [0] * len(replicas)  # handles of this call given to each replica so far
    try:
        for h in handles:
            taken.append(_allocate(replicas, h, placed, max_model_len))
        for replica in {id(r): r for r, _ in taken}.values():
            mine = [(h, t) for h, (r, t) in zip(handles, taken) if r is replica and t]
            if mine:
                _pull(replica, mine, timeout_s)
    except BaseException:
        for replica, table in taken:
            replica.free_kv(table)
        raise
    return [_enter(r, h, t, params) for h, (r, t) in zip(handles, taken)]


def _allocate(replicas: list[Replica], h: KVHandle, placed: list[int],
              max_model_len: int) -> tuple[Replica, list[int]]:
    """Blocks for the handle's prompt and first token on the least loaded replica with room,
    counting the handles of this call already placed (their requests enter only at the end).
    A handle of exactly max_model_len tokens ends with its first token, as `generate` of that
    prompt does: it needs no blocks and no pull."""
    if h.num_tokens >= max_model_len:
        return replicas[0], []
    for i in sorted(range(len(replicas)), key=lambda i: replicas[i].load + placed[i]):
        table = replicas[i].reserve_kv(h.num_tokens + 1)
        if table is not None:
            placed[i] += 1
            return replicas[i], table
    block_size = h.fingerprint.block_size  # checked equal to this engine's
    need = -(-(h.num_tokens + 1) // block_size)
    free, total = max(r.kv_room() for r in replicas)
    where = "the destination has" if len(replicas) == 1 else "its roomiest replica has"
    raise InvalidRequestError(
        f"{h!r} needs {need} blocks of {block_size} tokens but {where} {free} free of {total}; "
        f"raise kv_cache_gb, decode fewer handles at once, or wait for running requests to finish")


def _pull(replica: Replica, items: list[tuple[KVHandle, list[int]]], timeout_s: float) -> None:
    work = [(h.ranks, head_owners(h), table, h.num_tokens) for h, table in items]
    # the pull gives up well inside the step timeout, so a hung source fails this call and not
    # the destination's own group (whose wait on its ranks is bounded by that timeout)
    per_rank = replica.run_on_ranks(import_kv, work, 0.75 * timeout_s)
    for rank, errors in enumerate(per_rank):
        for (h, _), error in zip(items, errors):
            if error is not None:
                raise KVTransferError(f"{h!r}: destination rank {rank} could not pull its K/V "
                                      f"({error}); is the source engine shut down or a source rank "
                                      f"dead? Nothing was kept: retry, or prefill again")


def _enter(replica: Replica, h: KVHandle, table: list[int], params: SamplingParams) -> Sequence:
    seq = Sequence(list(h.prompt_token_ids), params)
    seq.token_ids.append(h.first_token)
    seq.block_table = table
    seq.num_computed_tokens = h.num_tokens  # the prompt's K/V are in place; the first token's not
    seq.first_token_time = time.perf_counter()
    if replica.adopt(seq):  # finished at once: EOS or max_tokens=1
        seq.future.set_result(seq)
    return seq
