"""Placement on a local multi-node Ray cluster, run as its own process.

    python -m tests.multinode_check [--model DIR] [--keep-going]

Builds a `ray.cluster_utils.Cluster` of two nodes with 2 CPUs each on this machine (distinct node
ids, one IP), connects to it, and checks what `tests/test_multinode.py` asserts:

- a RankGroup pinned to a node id (`bundle_label_selector` on `ray.io/node-id`) lands on that
  node, and one pinned to a full node fails to place instead of landing elsewhere;
- `LLM(model, tp=2, dp=2)`: each replica's ranks share one node, the two replicas use two nodes,
  and its greedy tokens and first-step logits equal a single-rank `LLM(model)`'s;
- `LLM(model, tp=3)` (3 CPUs on one node, while the cluster has 4 in all) fails at once with
  `ConfigError`;
- `LLM(model, tp=2, cp=2)`: each TP group on one node, the two context ranks on the two nodes
  (their ring crosses nodes), tokens and logits equal the single rank's; `cp=3, tp=2` (6 CPUs)
  fails at once naming the shortfall.

It prints one JSON line (prefixed `RESULT `) with what it saw, and always shuts the cluster down.
It runs in its own process because a pytest session may already hold a Ray connection, and it keeps
every Ray file (sessions, the `ray_current_cluster` address file) in a private $RAY_TMPDIR so that no
other Ray on this machine finds or joins this cluster.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NODES, CPUS_PER_NODE = 2, 2
MAX_TOKENS = 6


class RankOf:
    """The smallest rank worker: it knows its rank (this module is __main__, so Ray workers get
    the class by value)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank

    def rank_of(self) -> int:
        return self.rank


def _private_ray_env() -> str:
    """A short private temp dir for this cluster (socket paths must stay under ~107 bytes)."""
    tmp = tempfile.mkdtemp(prefix="rmn", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp
    # Keep Ray's token authentication on: the cluster, this driver and every worker use the token.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.pop("RAY_ADDRESS", None)  # never join some other cluster
    return tmp


def _ensure_token() -> None:
    """Token mode needs a token (~/.ray/auth_token); a fresh machine may have none yet."""
    from ray._private.authentication.authentication_token_setup import (
        ensure_token_if_auth_enabled)

    ensure_token_if_auth_enabled({}, create_token_if_missing=True)


def _prompts(vocab: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 17, 33, 9)]


def _run(llm, prompts) -> dict:
    from engine import SamplingParams

    pre = llm.prefill(prompts)
    gen = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return {"logits": [p.logits for p in pre], "tokens": [g.token_ids for g in gen]}


def _max_diff(logits, reference) -> float:
    return max((a - b).abs().max().item() for a, b in zip(logits, reference))


def _check_pinning(node_ids: list[str]) -> dict:
    """RankGroup's `node_id` (a `bundle_label_selector` on `ray.io/node-id`) on its own.

    A 2-rank group pinned to the node the driver is not on (left to itself Ray would place it on
    the driver's node, which is free); then, while that group fills its node, a 1-rank group
    pinned to the same full node must fail to place rather than land on the free one.
    """
    import ray

    from parallel.ray.rank_group import GroupOptions, RankGroup, RankGroupError

    driver = ray.get_runtime_context().get_node_id()
    [node] = [n for n in node_ids if n != driver]
    out: dict = {"node": node, "overfull": None}
    with RankGroup(RankOf, GroupOptions(world_size=2, init_timeout_s=30, node_ids=[node])) as g:
        out["node_ids"], out["ranks"] = g.node_ids(), g.collect(g.launch(RankOf.rank_of))
        t0 = time.perf_counter()
        try:
            RankGroup(RankOf, GroupOptions(world_size=1, init_timeout_s=3,
                                         node_ids=[node])).shutdown()
        except RankGroupError as e:
            out["overfull"] = {"error": str(e), "s": round(time.perf_counter() - t0, 2)}
    return out


def _fails_at_once(make) -> dict | None:
    """How `make()` failed (None if it did not), and how long it took."""
    from engine import ConfigError

    t0 = time.perf_counter()
    try:
        make().shutdown()
        return None
    except Exception as e:  # noqa: BLE001 - the test asserts on the type and message
        return {"type": type(e).__name__, "message": str(e), "s": time.perf_counter() - t0,
                "is_config_error": isinstance(e, ConfigError)}


def _check_context_parallel(model: str, prompts, ref: dict, result: dict) -> None:
    """tp=2 x cp=2 on two 2-CPU nodes: each TP group fills a node, the ring crosses them."""
    from engine import LLM

    cp_only = dict(enable_prefix_caching=False, init_timeout_s=60)
    result["cp_too_big"] = _fails_at_once(lambda: LLM(model, tp=2, cp=3, **cp_only))
    t0 = time.perf_counter()
    with LLM(model, tp=2, cp=2, **cp_only) as llm:
        result["cp_placement"] = llm.placement()
        got = _run(llm, prompts)
    result["cp_s"] = round(time.perf_counter() - t0, 2)
    result["cp_tokens"] = got["tokens"]
    result["cp_max_logit_diff"] = _max_diff(got["logits"], ref["logits"])


def check(model: str, result: dict) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from engine import LLM

    t0 = time.perf_counter()
    with LLM(model) as single:
        prompts = _prompts(single.model_config.vocab_size)
        ref = _run(single, prompts)
    result["single_rank_s"] = round(time.perf_counter() - t0, 2)

    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": CPUS_PER_NODE})
    try:
        for _ in range(NODES - 1):
            cluster.add_node(num_cpus=CPUS_PER_NODE)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        result["cluster_start_s"] = round(time.perf_counter() - t0, 2)
        result["nodes"] = {n["NodeID"]: n["Resources"].get("CPU", 0) for n in ray.nodes()
                           if n["Alive"]}
        result["node_labels"] = {n["NodeID"]: n.get("Labels", {}) for n in ray.nodes()
                                 if n["Alive"]}
        result["driver_node"] = ray.get_runtime_context().get_node_id()

        t0 = time.perf_counter()
        result["pinning"] = _check_pinning(list(result["nodes"]))
        result["pinning_s"] = round(time.perf_counter() - t0, 2)

        # A TP group larger than any node fails before any actor starts.
        result["tp3_error"] = _fails_at_once(lambda: LLM(model, tp=3, init_timeout_s=30))

        t0 = time.perf_counter()
        with LLM(model, tp=2, dp=2, init_timeout_s=60, kv_cache_gb=0.02) as llm:
            result["engine_start_s"] = round(time.perf_counter() - t0, 2)
            result["placement"] = llm.placement()
            t0 = time.perf_counter()
            got = _run(llm, prompts)
            result["run_s"] = round(time.perf_counter() - t0, 2)
            result["replica_lookup_tokens"] = [
                s["prefix_lookup_tokens"] for s in llm.cache_stats()["replicas"]]
        result["tokens"] = got["tokens"]
        result["reference_tokens"] = ref["tokens"]
        result["max_logit_diff"] = _max_diff(got["logits"], ref["logits"])
        _check_context_parallel(model, prompts, ref, result)
        # Every rank actor was killed with its group: the cluster's CPUs are all free again.
        deadline = time.monotonic() + 10
        while ray.available_resources().get("CPU", 0) < NODES * CPUS_PER_NODE \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        result["cpus_free_after"] = ray.available_resources().get("CPU", 0)
    finally:
        t0 = time.perf_counter()
        ray.shutdown()
        cluster.shutdown()
        result["shutdown_s"] = round(time.perf_counter() - t0, 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="an HF-style model directory (default: build tiny 'uneven')")
    args = parser.parse_args()

    tmp = _private_ray_env()
    sys.path.insert(0, str(ROOT))  # engine.loading.synthetic, and the repo for Ray workers
    os.chdir(ROOT)  # Ray workers get the driver's cwd on sys.path
    result: dict = {"ok": False}
    start = time.perf_counter()
    try:
        _ensure_token()
        model = args.model
        if model is None:
            from engine.loading.synthetic import build

            model = str(build("uneven", Path(tmp)))
        check(model, result)
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - reported in the JSON and on stderr
        result["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        result["total_s"] = round(time.perf_counter() - start, 2)
        shutil.rmtree(tmp, ignore_errors=True)
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
