"""Placement over several Ray nodes: a local `ray.cluster_utils.Cluster` of 2 nodes x 2 CPUs.

The cluster lives in a subprocess (tests/multinode_check.py), because this pytest session may
already be connected to its own Ray; that script reports what it saw as JSON and the asserts are
here. It keeps its Ray files in a private $RAY_TMPDIR, runs in its own session, and whatever it
leaves running is killed and fails the test.
"""
from __future__ import annotations

import json
import sys

import pytest

from tests import subproc

TIMEOUT_S = 300


@pytest.fixture(scope="module")
def report(tiny_model_dir):
    tmp = subproc.ray_tmpdir()
    try:
        r = subproc.run([sys.executable, "-m", "tests.multinode_check",
                         "--model", str(tiny_model_dir("uneven"))],
                        timeout=TIMEOUT_S, env=subproc.isolated_env(tmp))
    finally:
        subproc.remove(tmp)
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no RESULT line\n{r.explain()}"
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["ok"] and r.returncode == 0, f"{result.get('error')}\n{r.explain()}"
    assert not r.leaked, f"the cluster left processes running: {r.leaked}"
    return result


def test_cluster_has_two_nodes_of_two_cpus(report):
    assert sorted(report["nodes"].values()) == [2.0, 2.0]
    for node, labels in report["node_labels"].items():
        assert labels.get("ray.io/node-id") == node  # what rank_group's label selector matches


def test_node_id_pins_a_rank_group_to_that_node(report):
    pin = report["pinning"]
    assert pin["node"] != report["driver_node"]
    assert pin["node_ids"] == [pin["node"], pin["node"]]
    assert pin["ranks"] == [0, 1]
    # a rank pinned to a full node waits for it (and times out); it is not placed elsewhere
    assert pin["overfull"] is not None, "a rank pinned to a full node was placed anyway"
    assert "could not place 1 ranks" in pin["overfull"]["error"]


def test_each_tp_group_on_one_node_and_replicas_on_different_nodes(report):
    placement = report["placement"]
    assert len(placement) == 2  # dp=2
    replica_nodes = []
    for ranks in placement:
        assert len(ranks) == 2  # tp=2
        nodes = {node for _, node in ranks}
        assert len(nodes) == 1, f"a TP group spans nodes: {ranks}"
        replica_nodes.append(nodes.pop())
    assert len(set(replica_nodes)) == 2, f"both replicas on one node: {placement}"
    assert set(replica_nodes) == set(report["nodes"])


def test_multinode_engine_matches_single_rank(report):
    assert report["tokens"] == report["reference_tokens"]
    assert report["max_logit_diff"] <= 1e-4
    assert all(n > 0 for n in report["replica_lookup_tokens"])  # both replicas served requests
    assert report["cpus_free_after"] == 4.0  # every rank actor went away with its group


def test_tp_larger_than_any_node_fails_fast_with_config_error(report):
    err = report["tp3_error"]
    assert err is not None, "tp=3 on 2-CPU nodes was accepted"
    assert err["is_config_error"], err
    assert "a TP group must fit on one node" in err["message"]
    assert err["s"] < 5.0


def test_cp2_tp2_each_tp_group_on_one_node_context_ranks_on_two(report):
    ranks = report["cp_placement"]
    assert len(ranks) == 1 and len(ranks[0]) == 4  # one replica of cp=2 x tp=2, rank order
    nodes = [node for _, node in ranks[0]]
    # global rank r is context rank r // tp: ranks 0-1 are one TP group, ranks 2-3 the other
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3], ranks
    assert nodes[0] != nodes[2], f"both context ranks on one node: {ranks}"
    assert set(nodes) == set(report["nodes"])
    assert report["cp_tokens"] == report["reference_tokens"]
    assert report["cp_max_logit_diff"] <= 1e-4


def test_cp_times_tp_larger_than_the_cluster_names_the_shortfall(report):
    err = report["cp_too_big"]
    assert err is not None and err["is_config_error"], err
    assert "1 replica(s) x cp=3 x tp=2 need 6 CPUs but the Ray cluster has 4, 2 short" \
        in err["message"]
    assert err["s"] < 5.0
