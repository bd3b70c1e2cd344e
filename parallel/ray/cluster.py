"""Connecting to Ray and deciding which node each tensor-parallel group lives on."""
from __future__ import annotations

import os

import ray

# A local cluster the engine starts itself advertises at least this many logical CPUs, so several
# engines in one process (a prefill and a decode group, say) fit on a small machine: their ranks
# then share the real cores, each rank running torch on one thread.
LOCAL_LOGICAL_CPUS = 16


def connect(address: str | None = None) -> None:
    """Join the cluster at `address` (or $RAY_ADDRESS, or one `ray start` left on this machine);
    otherwise start a local one. Ray's token authentication stays on, and a cluster the engine
    starts serves no dashboard."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        _send_auth_token_if_any()
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, LOCAL_LOGICAL_CPUS), include_dashboard=False,
                 log_to_driver=False)


def _send_auth_token_if_any() -> None:
    """Ray sends its token (~/.ray/auth_token, $RAY_AUTH_TOKEN) to a cluster it finds by itself,
    but to an explicit address only under RAY_AUTH_MODE=token; a cluster without auth accepts
    a token too, so send one whenever there is one."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available)
    except ImportError:  # a Ray without token authentication
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def _unit(device: str) -> str:
    return "CPU" if device == "cpu" else "GPU"


def alive_nodes(device: str) -> dict[str, float]:
    """Node id -> how many devices of the kind this engine uses it has, for every live node."""
    unit = _unit(device)
    return {n["NodeID"]: n["Resources"].get(unit, 0.0) for n in ray.nodes()
            if n["Alive"] and n["Resources"].get(unit, 0.0) > 0}


def plan_replicas(dp: int, tp: int, device: str, cpus_per_rank: float = 1.0,
                  cp: int = 1) -> list[list[str]]:
    """For each of `dp` replicas, a node for each of its `cp` TP groups: a TP group is packed on
    one node; a replica's next TP group goes on the node of its previous one while that has room
    (its ring exchange stays on the node), else on the node with the most devices left, so
    replicas spread. Fails at once, naming the shortfall, when the cluster is too small; a
    cluster big enough but busy is caught by the placement timeout."""
    unit = _unit(device)
    left = alive_nodes(device)
    per_group = tp * (cpus_per_rank if unit == "CPU" else 1)
    need, have = dp * cp * per_group, sum(left.values())
    if need > have:
        layout = f"cp={cp} x tp={tp}" if cp > 1 else f"tp={tp}"
        raise ValueError(f"{dp} replica(s) x {layout} need {need:g} {unit}s but the Ray cluster "
                         f"has {have:g}, {need - have:g} short; lower tp/cp/dp or cpus_per_rank, "
                         f"or add nodes")
    plan: list[list[str]] = []
    for replica in range(dp):
        nodes: list[str] = []
        for _ in range(cp):
            fits = [n for n in left if left[n] >= per_group]
            if not fits:
                raise ValueError(f"no node has {tp} {unit}s left for a TP group of replica "
                                 f"{replica}: a TP group must fit on one node ({unit}s per node: "
                                 f"{sorted(left.values(), reverse=True)})")
            taken = [n for r in plan for n in r]
            node = (nodes[-1] if nodes and nodes[-1] in fits
                    else max(fits, key=lambda n: (left[n], -taken.count(n))))
            nodes.append(node)
            left[node] -= per_group
        plan.append(nodes)
    return plan
