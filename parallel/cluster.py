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


def plan_replicas(dp: int, tp: int, device: str, cpus_per_rank: float = 1.0) -> list[str]:
    """A node for each of `dp` TP groups: every group packed on one node, groups spread over
    the nodes with the most devices left. Fails at once, naming the shortfall, when the
    cluster is too small; a cluster big enough but busy is caught by the placement timeout."""
    unit = _unit(device)
    left = alive_nodes(device)
    per_group = tp * (cpus_per_rank if unit == "CPU" else 1)
    if dp * per_group > sum(left.values()):
        raise ValueError(f"{dp} replica(s) x tp={tp} need {dp * per_group:g} {unit}s but the Ray "
                         f"cluster has {sum(left.values()):g}; lower tp/dp or cpus_per_rank, or "
                         f"add nodes")
    chosen: list[str] = []
    for replica in range(dp):
        fits = [n for n in left if left[n] >= per_group]
        if not fits:
            raise ValueError(f"no node has {tp} {unit}s left for replica {replica}: a TP group must "
                             f"fit on one node ({unit}s per node: {sorted(left.values(), reverse=True)})")
        node = max(fits, key=lambda n: (left[n], -chosen.count(n)))
        chosen.append(node)
        left[node] -= per_group
    return chosen
