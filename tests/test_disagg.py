"""Disaggregated prefill: one engine prefills and hands its K/V to a decode engine of another TP.

References: Hugging Face `transformers` on the same weights (greedy tokens, K/V per head), and
single-engine `generate` for seeded sampling. Engines share the session Ray cluster (4 logical
CPUs): ranks ask for half a CPU each so a tp=2 and a tp=3 engine fit side by side.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import pickle
import signal
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError, KVPinnedError, RankFailure
from engine.transfer import KVHandle, KVTransferError
from tests.reference import hf_greedy, hf_kv, hf_model

SMALL = dict(block_size=4, kv_cache_gb=0.01, cpus_per_rank=0.5)
LONG = [5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33, 35, 37, 39, 41]  # 19 tokens
SHORT = [3, 4, 5, 6, 7]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=0.9, top_k=50, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def uneven_path(tiny_model_dir):
    return str(tiny_model_dir("uneven"))  # 6 query / 3 KV heads


@pytest.fixture(scope="module")
def hf(uneven_path):
    return hf_model(uneven_path)


@pytest.fixture(scope="module")
def engines(ray_cluster, uneven_path):
    """tp -> engine. The tp=2 engine chunks prompts (8-token budget), so its exports do too."""
    made = {1: LLM(uneven_path, **SMALL), 2: LLM(uneven_path, tp=2, max_num_batched_tokens=8, **SMALL),
            3: LLM(uneven_path, tp=3, **SMALL)}
    yield made
    for llm in made.values():
        llm.shutdown()


@pytest.fixture(scope="module")
def seeded_reference(engines):
    with engines[1].prefix_caching(False):  # leave the caches as the hand-offs will find them
        return [g.token_ids for g in engines[1].generate([LONG, SHORT], SEEDED)]


def _blocks_used(llm: LLM) -> int:
    return llm.cache_stats()["blocks_used"]


@pytest.mark.parametrize("src,dst", [(1, 1), (2, 1), (1, 2), (2, 3)])
def test_handoff_gives_single_engine_tokens(engines, hf, seeded_reference, src, dst):
    pre, dec = engines[src], engines[dst]
    outs = pre.prefill([LONG, SHORT], export_kv=True)
    assert _blocks_used(pre) == 5 + 2  # pinned: ceil(19/4) + ceil(5/4)
    handles = [pickle.loads(pickle.dumps(o.kv)) for o in outs]  # as a router would forward them
    gens = dec.decode(handles, GREEDY)
    assert [g.token_ids for g in gens] == [hf_greedy(hf, p, 6) for p in (LONG, SHORT)]
    seeded = pre.prefill([LONG, SHORT], SEEDED, export_kv=True)
    assert [g.token_ids for g in dec.decode([o.kv for o in seeded], SEEDED)] == seeded_reference
    assert _blocks_used(pre) == 0 and _blocks_used(dec) == 0


def test_prefix_hit_on_source(engines, hf):
    pre, dec = engines[2], engines[3]
    pre.prefill([LONG[:12]])  # caches three full blocks
    [out] = pre.prefill([LONG[:12] + [99, 98, 97]], export_kv=True)
    assert out.cached_tokens == 12
    [gen] = dec.decode([out.kv], GREEDY)
    assert gen.token_ids == hf_greedy(hf, LONG[:12] + [99, 98, 97], 6)


@pytest.mark.parametrize("src,dst,prompt", [(2, 3, [8, 6, 4, 2] * 4 + [1, 3]),
                                            (1, 2, [9, 8, 7, 6] * 4 + [5])])
def test_destination_ranks_hold_their_heads(engines, hf, src, dst, prompt):
    pre, dec = engines[src], engines[dst]
    [out] = pre.prefill([prompt], export_kv=True)
    layers = hf.config.num_hidden_layers
    source_kv = [pre.read_kv(layer, out.block_table, 16) for layer in range(layers)]
    dec.decode([out.kv], SamplingParams(max_tokens=2))
    # the adopted blocks entered the destination's prefix cache: a prefill of the same prompt
    # finds the 16 handed-off positions there and shows where they are
    [again] = dec.prefill([prompt])
    assert again.cached_tokens == 16
    reference = hf_kv(hf, prompt)
    for layer in range(layers):
        per_rank = dec.read_kv(layer, again.block_table, 16)
        for info, (k, v) in zip(dec.rank_info(), per_rank):
            lo, hi = info.kv_heads
            torch.testing.assert_close(k, reference[layer][0][:16, lo:hi], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v, reference[layer][1][:16, lo:hi], atol=1e-4, rtol=1e-4)
            # bit for bit what the source rank holding each head stored
            src_k = torch.cat([sk for sk, _ in source_kv[layer]], dim=1)
            src_heads = [h for i in pre.rank_info() for h in range(*i.kv_heads)]
            assert torch.equal(k, src_k[:, [src_heads.index(h) for h in range(lo, hi)]])



def test_destination_replicating_kv_heads(engines, hf, uneven_path):
    """tp=4 over 3 KV heads: query heads split 2+2+1+1, so ranks 2 and 3 both hold KV head 2;
    each pulls its own copy."""
    prompt = [4, 4, 8, 8] * 4 + [15, 16]
    with LLM(uneven_path, tp=4, **{**SMALL, "cpus_per_rank": 0.25}) as dec:
        heads = [info.kv_heads for info in dec.rank_info()]
        assert sum(hi - lo for lo, hi in heads) > 3  # some KV head lives on two ranks
        outs = engines[2].prefill([prompt, LONG], export_kv=True)
        gens = dec.decode([o.kv for o in outs], GREEDY)
        assert [g.token_ids for g in gens] == [hf_greedy(hf, p, 6) for p in (prompt, LONG)]
        [again] = dec.prefill([prompt])
        assert again.cached_tokens == 16
        reference = hf_kv(hf, prompt)
        for layer in range(hf.config.num_hidden_layers):
            for (lo, hi), (k, v) in zip(heads, dec.read_kv(layer, again.block_table, 16)):
                torch.testing.assert_close(k, reference[layer][0][:16, lo:hi], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(v, reference[layer][1][:16, lo:hi], atol=1e-4, rtol=1e-4)


def _decode_elsewhere(model: str, handle: KVHandle, params: SamplingParams) -> list[int]:
    """In a Ray task's own process: a fresh engine decodes a forwarded handle."""
    with LLM(model, **{**SMALL, "cpus_per_rank": 1.0}) as llm:
        return llm.decode([handle], params)[0].token_ids


def test_handle_decoded_in_another_process(engines, hf, uneven_path):
    import ray

    outs = [engines[2].prefill([LONG], export_kv=True)[0],  # rank actors serve the pull
            engines[1].prefill([SHORT], export_kv=True)[0]]  # an in-process rank published
    task = ray.remote(num_cpus=0.5)(_decode_elsewhere)
    got = ray.get([task.remote(uneven_path, o.kv, GREEDY) for o in outs], timeout=300)
    assert got == [hf_greedy(hf, LONG, 6), hf_greedy(hf, SHORT, 6)]
    assert _blocks_used(engines[2]) == 0 and _blocks_used(engines[1]) == 0

def test_release_and_ttl_unpin_blocks(engines, uneven_path):
    pre, dec = engines[1], engines[2]
    [out] = pre.prefill([LONG], export_kv=True)
    assert _blocks_used(pre) == 5
    pre.release(out.kv)
    assert _blocks_used(pre) == 0
    with pytest.raises(InvalidRequestError, match="already released"):
        dec.decode([out.kv])
    with pytest.raises(InvalidRequestError, match="not exported by this engine"):
        pre.release(out.kv)
    with LLM(uneven_path, kv_handle_ttl_s=0.5, **SMALL) as short_lived:
        [out] = short_lived.prefill([LONG], export_kv=True)
        time.sleep(1.0)
        assert _blocks_used(short_lived) == 0
        with pytest.raises(InvalidRequestError, match="already expired"):
            dec.decode([out.kv])
    assert _blocks_used(dec) == 0


def _object_census() -> tuple[int, int]:
    """(objects in the object stores, entries in every process's reference table), summed over
    the cluster's live nodes as each raylet reports them (`GetNodeStats`, what `ray memory`
    reads; no dashboard needed). This observes Ray itself, not the engine's bookkeeping: the
    store counts K/V an in-process source put, wherever the refs went; the reference tables
    (driver, rank actors, lease table) count every ref still held, small objects kept inline by
    their owner included, and the destination ranks' pull replies while they are alive."""
    import ray
    from ray._private.internal_api import node_stats

    objects = refs = 0
    for node in ray.nodes():
        if node["Alive"]:
            reply = node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], True)
            objects += reply.store_stats.num_local_objects
            refs += sum(len(worker.object_refs) for worker in reply.core_workers_stats)
    return objects, refs


def _settles_to(expected: tuple[int, int] | None, timeout_s: float = 15.0) -> tuple[int, int]:
    """The census once it equals `expected` (None: once it stops changing for a second); Ray
    frees objects asynchronously. On timeout, the last reading."""
    gc.collect()
    deadline, last, since = time.monotonic() + timeout_s, _object_census(), time.monotonic()
    while time.monotonic() < deadline:
        if last == expected or (expected is None and time.monotonic() - since >= 1.0):
            return last
        time.sleep(0.2)
        now = _object_census()
        if now != last:
            last, since = now, time.monotonic()
    return last


@pytest.mark.parametrize("src,dst", [(1, 2), (2, 1)])  # an in-process source that puts its
def test_nothing_leaks(engines, uneven_path, src, dst):  # K/V; rank actors that serve pulls
    """No object-store object, reference or pinned block outlives a handle that was decoded
    (forwarded by pickle first, as a router would), released, or left to expire. The objects of
    an in-process source live as long as a copy of its handle does (Ray's reference counting),
    so each case drops its handles, as a caller does once it is done."""
    dec = engines[dst]
    with LLM(uneven_path, tp=src, kv_handle_ttl_s=1.0, **SMALL) as pre:
        def pinned() -> tuple[int, int]:
            stats = pre.cache_stats()
            return stats["blocks_used"], stats["kv_handles_pinned"]

        def decode_forwarded() -> None:
            outs = pre.prefill([LONG, SHORT], export_kv=True)
            dec.decode([pickle.loads(pickle.dumps(o.kv)) for o in outs], GREEDY)

        pre.generate([SHORT])
        base = _settles_to(None)
        decode_forwarded()
        # one entry more for good: the lease table's actor handle, made by the first export
        base = (base[0], base[1] + 1)
        assert _settles_to(base) == base and pinned() == (0, 0)
        decode_forwarded()  # and nothing more on `pre`: its loop thread must not keep handles
        assert _settles_to(base) == base and pinned() == (0, 0)
        [out] = pre.prefill([LONG], export_kv=True)
        assert pinned() == (5, 1)
        if src == 1:  # the census sees the 2 layers x 3 KV heads put, and their refs
            assert _object_census() == (base[0] + 6, base[1] + 6)
        pre.release(out.kv)
        del out
        assert _settles_to(base) == base and pinned() == (0, 0)
        outs = pre.prefill([LONG, SHORT], export_kv=True)
        assert pinned() == (7, 2)
        del outs
        time.sleep(1.2)  # past kv_handle_ttl_s
        assert _settles_to(base) == base and pinned() == (0, 0)
    assert _blocks_used(dec) == 0 and dec.cache_stats()["kv_handles_pinned"] == 0


def test_bad_handles_fail_cleanly(engines, hf, tiny_model_dir, uneven_path):
    pre, dec = engines[2], engines[1]
    [out] = pre.prefill([LONG], export_kv=True)
    h = out.kv
    with LLM(str(tiny_model_dir("llama")), **SMALL) as other:
        with pytest.raises(InvalidRequestError, match="another model"):
            other.decode([h])
    with LLM(uneven_path, dtype="bfloat16", compile=False, **SMALL) as bf16:
        with pytest.raises(InvalidRequestError, match="holds float32 K/V"):
            bf16.decode([h])
    with LLM(uneven_path, **{**SMALL, "block_size": 8}) as wide:
        with pytest.raises(InvalidRequestError, match="block_size=4"):
            wide.decode([h])
    corrupt = [dataclasses.replace(h, ranks=h.ranks[:1]),
               dataclasses.replace(h, first_token=10**6),
               dataclasses.replace(h, ranks=(dataclasses.replace(h.ranks[0], kv_heads=(0, 9)),
                                             h.ranks[1]))]
    for bad in corrupt:
        with pytest.raises(InvalidRequestError, match="corrupted"):
            dec.decode([pickle.loads(pickle.dumps(bad))])
    with pytest.raises(InvalidRequestError, match="KVHandles"):
        dec.decode([out])
    with pytest.raises(InvalidRequestError, match="twice"):
        dec.decode([h, h])
    with pytest.raises(InvalidRequestError, match="exported by this engine"):
        pre.decode([h])  # its rank actors would wait on themselves
    assert _blocks_used(dec) == 0
    [gen] = dec.decode([h], GREEDY)  # nothing above consumed or half-wrote it
    assert gen.token_ids == hf_greedy(hf, LONG, 6)
    with pytest.raises(InvalidRequestError, match="already used"):
        dec.decode([h], GREEDY)
    assert _blocks_used(pre) == 0 and _blocks_used(dec) == 0


def test_destination_cache_too_small(engines, hf, uneven_path):
    pre = engines[1]
    per_token = pre.rank_info()[0].kv_bytes_per_token
    # 8 blocks of 4 tokens: one request of max_model_len=32, not three 19-token prompts
    with LLM(uneven_path, max_model_len=32, **{**SMALL, "kv_cache_gb": 8 * 4 * per_token / 2**30}) as tiny:
        outs = pre.prefill([LONG, LONG[1:], LONG[2:]], export_kv=True)
        with pytest.raises(InvalidRequestError, match="free of 8"):
            tiny.decode([o.kv for o in outs], GREEDY)
        assert _blocks_used(tiny) == 0
        gens = tiny.decode([outs[0].kv], GREEDY)  # the handles were handed back untouched
    assert gens[0].token_ids == hf_greedy(hf, LONG, 6)
    assert [g.token_ids for g in engines[2].decode([o.kv for o in outs[1:]], GREEDY)] == \
        [hf_greedy(hf, p, 6) for p in (LONG[1:], LONG[2:])]


def _cache_of(llm: LLM, blocks: int) -> float:
    """kv_cache_gb for exactly `blocks` blocks of 4 tokens of `llm`'s model."""
    return blocks * 4 * llm.rank_info()[0].kv_bytes_per_token / 2**30


def test_exports_never_starve_the_source(engines, hf, uneven_path):
    """max_model_len=32 over 8 blocks of 4: two pinned 13-token prompts took the whole cache,
    and the next request failed inside the engine ("scheduler found nothing to run")."""
    a, b, c = LONG[:13], LONG[1:14], LONG[2:15]
    one_request = {**SMALL, "max_model_len": 32, "kv_cache_gb": _cache_of(engines[1], 8)}
    with LLM(uneven_path, **one_request) as llm:
        with pytest.raises(KVPinnedError, match=r"8 must stay free for one max_model_len=32"):
            llm.prefill([a, b], export_kv=True)
        assert _blocks_used(llm) == 0  # the call's other export was given back too
        assert llm.generate([LONG[:17]], GREEDY)[0].token_ids == hf_greedy(hf, LONG[:17], 6)
    # 12 blocks: room to pin 4 and still serve a max_model_len prompt beside them
    with LLM(uneven_path, **{**one_request, "kv_cache_gb": _cache_of(engines[1], 12)}) as llm:
        [kept] = llm.prefill([a], export_kv=True)
        with pytest.raises(KVPinnedError, match=rf"\({kept.kv.handle_id[:8]}\).*LLM.release\(kv\)"):
            llm.prefill([b], export_kv=True)
        assert llm.cache_stats()["blocks_pinned"] == 4
        full = (LONG * 2)[:32]
        assert llm.generate([full[:31]], GREEDY)[0].token_ids == hf_greedy(hf, full[:31], 1)
        with pytest.raises(InvalidRequestError, match="takes a KVHandle"):
            llm.release(kept)  # its repr (with the logits) once made the message
        llm.release(kept.kv)
        with pytest.raises(KVPinnedError, match=r"1 earlier prompt\(s\) of this call"):
            llm.prefill([b, c], export_kv=True)  # b takes the 4 blocks c needed
        assert _blocks_used(llm) == 0
        [again] = llm.prefill([b], export_kv=True)  # the released blocks serve the next export
        assert engines[2].decode([again.kv], GREEDY)[0].token_ids == hf_greedy(hf, b, 6)
        assert _blocks_used(llm) == 0


def test_a_handle_of_exactly_max_model_len(ray_cluster, uneven_path, hf):
    """generate gives a max_model_len prompt its first token and "length"; decode of its handle
    refused it and left its blocks pinned until the TTL."""
    prompt = (LONG * 2)[:16]
    with LLM(uneven_path, max_model_len=16, **SMALL) as llm:
        [gen] = llm.generate([prompt], GREEDY)
        [out] = llm.prefill([prompt], GREEDY, export_kv=True)
        [dec] = llm.decode([out.kv], GREEDY)  # an in-process source may decode its own
        assert gen.token_ids == dec.token_ids == hf_greedy(hf, prompt, 1)
        assert gen.finish_reason == dec.finish_reason == "length"
        stats = llm.cache_stats()
        assert stats["blocks_used"] == 0 and stats["kv_handles_pinned"] == 0


def test_a_fine_tune_is_another_model(engines, uneven_path, tmp_path):
    """One weight of layer 0's k_proj changed, in the KV head a tp=2 engine's rank 1 loads:
    the old check hashed a few embedding rows and the final norm only, and the fine-tune's
    handle decoded on the base model without complaint."""
    import shutil

    from safetensors.torch import load_file, save_file

    tuned = tmp_path / "tuned"
    shutil.copytree(uneven_path, tuned)
    [file] = tuned.glob("*.safetensors")
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.k_proj.weight"][30, 7] += 1e-3  # row 30: KV head 2 of 3
    save_file(tensors, file, metadata={"format": "pt"})
    with LLM(str(tuned), tp=2, **SMALL) as fine_tune:
        assert [i.kv_heads for i in fine_tune.rank_info()][1] == (2, 3)
        [out] = fine_tune.prefill([LONG], export_kv=True)
        with pytest.raises(InvalidRequestError, match="another model"):
            engines[1].decode([out.kv], GREEDY)
        [base] = engines[2].prefill([LONG], export_kv=True)
        with pytest.raises(InvalidRequestError, match="another model"):
            fine_tune.decode([base.kv], GREEDY)
        engines[2].release(base.kv)
    assert _blocks_used(engines[1]) == 0


def test_hung_dead_and_shut_down_source(engines, hf, uneven_path):
    dec = engines[2]
    source = LLM(uneven_path, executor="ray", **SMALL)  # one rank, in its own actor
    try:
        outs = source.prefill([LONG, SHORT, LONG[3:]], export_kv=True)
        pid = source.rank_pids()[0][0]
        with LLM(uneven_path, step_timeout_s=4, **SMALL) as impatient:
            os.kill(pid, signal.SIGSTOP)  # the rank holding the blocks stops answering
            try:
                with pytest.raises(KVTransferError, match="GetTimeoutError"):
                    impatient.decode([outs[0].kv], GREEDY)
            finally:
                os.kill(pid, signal.SIGCONT)
            assert _blocks_used(impatient) == 0
            # the failed pull handed the lease back: the same handle decodes now
            assert impatient.decode([outs[0].kv], GREEDY)[0].token_ids == hf_greedy(hf, LONG, 6)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RankFailure):
            source.generate([SHORT])
        with pytest.raises(KVTransferError, match="could not pull"):
            dec.decode([outs[1].kv], GREEDY)
        assert _blocks_used(dec) == 0
    finally:
        source.shutdown()
    with pytest.raises(KVTransferError, match="shut down"):
        dec.decode([outs[2].kv], GREEDY)
    assert [g.token_ids for g in dec.generate([SHORT], GREEDY)] == [hf_greedy(hf, SHORT, 6)]

def test_smollm2_tp2_to_tp1(ray_cluster, smollm2_llm):
    prompts = ["The capital of France is", "Write a haiku about the sea."]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    reference = [g.token_ids for g in smollm2_llm.generate(prompts, params)]
    with LLM("smollm2", tp=2, max_model_len=512, kv_cache_gb=0.05, cpus_per_rank=0.5) as pre:
        outs = pre.prefill(prompts, export_kv=True)
        assert all(isinstance(o.kv, KVHandle) for o in outs)
        gens = smollm2_llm.decode([o.kv for o in outs], params)
        assert [g.token_ids for g in gens] == reference
        assert _blocks_used(pre) == 0


@pytest.mark.parametrize("routing,second_pair_hits", [("prefix_affinity", [24, 24]),
                                                      ("least_loaded", [0, 0])])
def test_routing_with_dp2(ray_cluster, uneven_path, hf, routing, second_pair_hits):
    shared_a, shared_b = [7, 1, 4] * 8, [2, 9, 6] * 8  # 24 tokens each: 6 full blocks of 4
    with LLM(uneven_path, dp=2, routing=routing, **SMALL) as llm:
        # one batch, both replicas idle: the first goes to replica 0, the second to the then
        # less loaded replica 1, whichever the routing
        llm.prefill([shared_a + [10], shared_b + [10]])
        # idle again: least-loaded sends the first of these to replica 0 (a miss: b is cached on
        # replica 1) and the second to replica 1 (a miss for a); prefix affinity sends each to
        # the replica holding its prefix
        outs = llm.prefill([shared_b + [11, 12], shared_a + [11, 12]])
        assert [o.cached_tokens for o in outs] == second_pair_hits
        per_replica = [r["prefix_hit_tokens"] for r in llm.cache_stats()["replicas"]]
        assert per_replica == second_pair_hits
        # a lone prompt with dp=2 is served like any other
        assert llm.generate([SHORT], GREEDY)[0].token_ids == hf_greedy(hf, SHORT, 6)


def test_disagg_app_serves_a_stream_of_requests(uneven_path):
    """`python -m launcher.disagg` as a person runs it: its own local Ray, tp=3 prefill + tp=2
    decode on this 2-core machine with the default one CPU per rank."""
    import sys

    from tests import subproc

    tmp = subproc.ray_tmpdir()
    try:
        r = subproc.run([sys.executable, "-m", "launcher.disagg", f"model.path={uneven_path}",
                         "prefill.tp=3", "decode.tp=2", "requests=3", "prompt_len=20",
                         "max_tokens=4", "arrival_rate=5", "engine.kv_cache_gb=0.01"],
                        timeout=300, env=subproc.isolated_env(tmp))
    finally:
        subproc.remove(tmp)
    assert r.returncode == 0, r.explain()
    assert "replica(s) of tp=3" in r.stdout and "replica(s) of tp=2" in r.stdout, r.explain()
    assert "output tokens/s" in r.stdout and not r.leaked, r.explain()
    rows = [line for line in r.stdout.splitlines() if line.strip().startswith("│")]
    assert [row.split("│")[-2].strip() for row in rows] == ["4", "4", "4"], r.explain()


@pytest.fixture(scope="module")
def dp2(ray_cluster, engines, uneven_path):
    """Two replicas of 8 blocks each (one max_model_len=32 request)."""
    with LLM(uneven_path, dp=2, max_model_len=32,
             **{**SMALL, "kv_cache_gb": _cache_of(engines[1], 8)}) as llm:
        yield llm


def test_decode_spreads_one_calls_handles_over_replicas(engines, hf, dp2):
    """Two handles of 5 blocks: both went to replica 0 ("3 free of 8") while replica 1 had 8."""
    prompts = [LONG, LONG[::-1]]
    outs = engines[1].prefill(prompts, export_kv=True)
    gens = dp2.decode([o.kv for o in outs], GREEDY)
    assert [g.token_ids for g in gens] == [hf_greedy(hf, p, 6) for p in prompts]
    assert [len(dp2.step_timings(r)) > 0 for r in (0, 1)] == [True, True]
    assert _blocks_used(engines[1]) == 0


def test_cache_stats_keys_do_not_depend_on_dp(engines, dp2):
    """dp=2 had only "replicas" and "kv_handles_pinned" at the top: code written for dp=1
    (stats["blocks_used"]) broke."""
    fresh = list(range(50, 62))  # in no cache yet
    before = dp2.cache_stats()["prefix_hit_tokens"]
    dp2.prefill([fresh])
    dp2.prefill([fresh + [3]])  # a hit of the 3 blocks cached by the first
    stats, one = dp2.cache_stats(), engines[1].cache_stats()
    assert set(stats) == set(one) and len(stats["replicas"]) == 2
    for key in ("blocks_total", "blocks_used", "blocks_free", "prefix_hit_tokens", "cached_blocks"):
        assert stats[key] == sum(r[key] for r in stats["replicas"]), key
    assert stats["blocks_total"] == 16 and stats["prefix_hit_tokens"] - before == 12


def test_an_export_after_its_replica_was_replaced_is_refused(engines):
    """A prefill's replica rebuilt (a rank failure) or restarted between the prefill's end and
    its export: the new ranks never held that K/V, so no handle may point at them. The race
    cannot be timed through the public API; the engine's own steps are run in that order."""
    llm = engines[1]
    [seq] = llm._sequences([LONG], SamplingParams(max_tokens=1))
    seq.pin_kv = True
    llm._core.submit([seq])
    llm._wait([seq])  # finished, its blocks pinned on replica 0
    llm._core.restart()  # the step loop's replicas are new objects now, their caches empty
    with pytest.raises(KVTransferError, match="replaced"):
        llm._exports.export([seq], llm._fingerprint)
    assert llm.cache_stats()["blocks_pinned"] == 0 and _blocks_used(llm) == 0
    assert llm.generate([SHORT], GREEDY)[0].token_ids  # still serving
