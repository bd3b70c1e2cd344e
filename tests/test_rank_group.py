"""RankGroup: SPMD calls over Ray rank actors, and every way a rank can fail without a hang."""
from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import pytest
import ray
import torch
import torch.distributed as dist

from parallel.ray.rank_group import GroupOptions, RankGroup, RankGroupError

# Ray workers cannot import this test module by name (pytest put tests/ on the driver's path
# only), so the toy workers below travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class ToyWorker:
    """A real rank worker: knows its rank and talks to the others through torch.distributed."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def whoami(self) -> int:
        return self.rank

    def pid(self) -> int:
        return os.getpid()

    def plumbing_frames(self) -> list[str]:
        """The group's own functions on the stack that called this method."""
        mine = os.path.join("parallel", "ray", "rank_group.py")
        return [f.name for f in traceback.extract_stack() if f.filename.endswith(mine)]

    def all_reduce(self) -> float:
        t = torch.tensor([self.rank + 1.0])
        dist.all_reduce(t)
        return t.item()

    def reject(self, x: object) -> None:
        raise ValueError(f"rank {self.rank} rejects {x!r}")

    def reject_on(self, rejecting_rank: int) -> int:
        if self.rank == rejecting_rank:
            raise ValueError(f"rank {self.rank} rejects its input")
        return self.rank

    def die_in_collective(self, dying_rank: int) -> float:
        if self.rank == dying_rank:
            os._exit(1)
        return self.all_reduce()

    def hang(self, hanging_rank: int) -> int:
        if self.rank == hanging_rank:
            time.sleep(3600)
        return self.rank


class BrokenWorker:
    def __init__(self, rank: int, world_size: int, pid_dir: str) -> None:
        Path(pid_dir, str(rank)).write_text(str(os.getpid()))
        raise RuntimeError("cannot load weights")


def rank_times(worker: ToyWorker, factor: int) -> int:
    """Not a ToyWorker method: the group runs it through the actor's `run`."""
    return worker.rank * factor


def _call(group: RankGroup, fn, *args) -> list:
    return group.collect(group.launch(fn, *args))


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"   # a zombie is dead, merely not reaped yet


def _still_alive(pids: list[int], within_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _live_placement_groups() -> list[str]:
    table = ray.util.placement_group_table()
    return [pg for pg, info in table.items() if info["state"] != "REMOVED"]


def test_all_reduce_on_every_rank_in_rank_order(ray_cluster):
    with RankGroup(ToyWorker, GroupOptions(world_size=2)) as group:
        assert group.world_size == 2
        assert _call(group, ToyWorker.all_reduce) == [1.0 + 2.0, 1.0 + 2.0]
        assert _call(group, ToyWorker.whoami) == [0, 1]
        assert _call(group, rank_times, 10) == [0, 10]
        # a worker method is the actor's own: no dispatch of the group's between Ray and it
        assert _call(group, ToyWorker.plumbing_frames) == [[], []]
        assert len(group.node_ips()) == 2
        pids = _call(group, ToyWorker.pid)
        assert len(set(pids)) == 2 and os.getpid() not in pids
    assert _still_alive(pids) == []
    assert _live_placement_groups() == []


def test_worker_error_on_every_rank_is_reraised_and_group_survives(ray_cluster):
    with RankGroup(ToyWorker, GroupOptions(world_size=2)) as group:
        with pytest.raises(ValueError, match="rejects 'bad'"):
            _call(group, ToyWorker.reject, "bad")
        assert _call(group, ToyWorker.all_reduce) == [3.0, 3.0]
        # Ranks that disagree are a group error, but nobody is stuck in a collective.
        with pytest.raises(RankGroupError, match="(?s)rank 1 .*reject_on.*rejects its input"):
            _call(group, ToyWorker.reject_on, 1)
        assert _call(group, ToyWorker.whoami) == [0, 1]


def test_rank_dying_mid_collective_fails_fast_and_leaves_no_process(ray_cluster):
    group = RankGroup(ToyWorker, GroupOptions(world_size=2, step_timeout_s=10))
    pids = _call(group, ToyWorker.pid)
    start = time.monotonic()
    with pytest.raises(RankGroupError, match="rank 1"):
        _call(group, ToyWorker.die_in_collective, 1)
    assert time.monotonic() - start < 20
    assert _still_alive(pids) == []
    assert _live_placement_groups() == []
    with pytest.raises(RankGroupError, match="shut down"):
        _call(group, ToyWorker.whoami)


def test_hanging_rank_times_out(ray_cluster):
    group = RankGroup(ToyWorker, GroupOptions(world_size=2, step_timeout_s=3))
    pids = _call(group, ToyWorker.pid)
    start = time.monotonic()
    with pytest.raises(RankGroupError, match="rank 1 .*hang.*did not answer"):
        _call(group, ToyWorker.hang, 1)
    assert 3 <= time.monotonic() - start < 10
    assert _still_alive(pids) == []
    group.shutdown()   # already torn down: a second shutdown is a no-op


def test_more_ranks_than_cpus_is_refused_in_time(ray_cluster):
    start = time.monotonic()
    with pytest.raises(RankGroupError, match="8 CPU.*4 CPU in total"):
        RankGroup(ToyWorker, GroupOptions(world_size=8, init_timeout_s=5))
    assert time.monotonic() - start < 10
    assert _live_placement_groups() == []


def test_failing_worker_factory_tears_the_group_down(ray_cluster, tmp_path):
    with pytest.raises(RankGroupError, match="(?s)failed to build its worker.*cannot load weights"):
        RankGroup(BrokenWorker, GroupOptions(world_size=2), pid_dir=str(tmp_path))
    pids = [int(f.read_text()) for f in tmp_path.iterdir()]
    assert len(pids) >= 1
    assert _still_alive(pids) == []
    assert _live_placement_groups() == []


def test_a_worker_method_named_like_the_actor_plumbing_is_refused_before_placing():
    class Clashing(ToyWorker):
        def join(self) -> None:  # the actor's own join() forms the process group
            pass

    with pytest.raises(TypeError, match=r"Clashing defines \['join'\].*rename"):
        RankGroup(Clashing, GroupOptions(world_size=2))
