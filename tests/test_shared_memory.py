"""parallel.shared_memory: sums and gathers of CPU ranks through a mapped file, in real processes
joined by a gloo group, against sums written here in plain torch (rank order, half precision
summed in float32 and rounded once); every rank's result bitwise alike; tensors of several
pieces, non-contiguous, empty; a started sum finished after others; inference mode on and off;
a rank that exits or stops answering; a folder that cannot be used (gloo keeps the sums)."""
from __future__ import annotations

import os
import pickle
from pathlib import Path
import time

import pytest
import torch
import torch.distributed as dist

from parallel import comm, shared_memory
from parallel.shared_memory import SLOT_BYTES, CollectiveError, SharedMemoryCollectives
from tests.process_group import run_in_group


def _inputs(world: int, shape: tuple, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Every rank's tensor, the same on each rank (one seed)."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=gen) * 50).to(dtype) for _ in range(world)]


def _plain_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """In rank order; bf16 in float32, rounded once."""
    total = parts[0].float() if parts[0].dtype == torch.bfloat16 else parts[0].clone()
    for part in parts[1:]:
        total = total + part.to(total.dtype)
    return total.to(parts[0].dtype)


def _attached(timeout_s: float = 30.0) -> SharedMemoryCollectives:
    shared, why = SharedMemoryCollectives.attach(None, timeout_s)
    assert shared is not None, why
    return shared


def _same_on_every_rank(x: torch.Tensor) -> None:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, x)
    assert all(torch.equal(other, everyone[0]) for other in everyone)


# (shape, make it non-contiguous): a decode row, a strided view, several slots' worth, empty
CASES = [((1, 576), False), ((7, 12), True), ((SLOT_BYTES // 4 + 37,), False), ((0, 5), False)]


def _sums(rank: int, world: int) -> None:
    shared = _attached()
    for seed, (dtype, (shape, strided)) in enumerate(
            (d, c) for d in (torch.float32, torch.bfloat16, torch.int64) for c in CASES):
        parts = _inputs(world, shape[::-1] if strided else shape, dtype, seed)
        if strided:
            parts = [p.t() for p in parts]
        mine = parts[rank].clone() if not strided else parts[rank].t().clone().t()
        assert mine.is_contiguous() == (not strided or mine.numel() <= 1)
        got = shared.all_reduce(mine)
        assert got is mine and got.shape == parts[0].shape
        assert torch.equal(got, _plain_sum(parts)), (dtype, shape)
        _same_on_every_rank(got)
    shared.close()


@pytest.mark.parametrize("world", [2, 3])
def test_sums_match_plain_torch_on_every_rank(world):
    run_in_group(world, _sums)


def _started_gathered_and_inference_mode(rank: int, world: int) -> None:
    shared = _attached()
    a, b, big = (_inputs(world, shape, torch.float32, seed)
                 for seed, shape in enumerate([(4, 64), (2, 64), (SLOT_BYTES // 4 + 1,)]))
    mine_a, mine_b, mine_big = a[rank].clone(), b[rank].clone(), big[rank].clone()
    with torch.inference_mode():  # views made here are used outside it below, and back
        assert shared.start(mine_a)
        shared.all_reduce(mine_b)  # finishes a's first
    assert torch.equal(mine_a, _plain_sum(a)) and torch.equal(mine_b, _plain_sum(b))
    assert not shared.start(mine_big)  # larger than a slot: summed whole by the caller
    shared.all_reduce(mine_big)
    assert torch.equal(mine_big, _plain_sum(big))
    for mode in (True, True, False, False, True):  # each of the two slot sets in each mode
        with torch.inference_mode(mode):
            rows = _inputs(world, (3, 10), torch.bfloat16, 7)
            gathered = shared.gather_to_first(rows[rank])
            if rank == 0:
                assert len(gathered) == world
                assert all(torch.equal(g, r) for g, r in zip(gathered, rows))
            else:
                assert gathered is None
    shared.close()


def test_started_sums_gathers_and_inference_mode():
    run_in_group(2, _started_gathered_and_inference_mode)


def _a_rank_leaves(rank: int, world: int, how: str, outcome: str) -> None:
    shared = _attached(timeout_s=2.0)
    shared.all_reduce(torch.ones(4))
    if rank == 1:
        if how == "exits":
            os._exit(0)  # no clean-up: as a killed process
        time.sleep(6)  # "stops": alive, never calling again
        return
    started = time.monotonic()
    try:
        shared.all_reduce(torch.ones(4))
    except CollectiveError as e:
        with open(outcome, "w") as f:
            f.write(f"{time.monotonic() - started:.2f} {e}")
    os._exit(0)  # rank 1 never reaches the group's teardown


@pytest.mark.parametrize("how,said,within", [
    ("exits", "rank(s) [1] of this group exited before they could copy its tensor in", 1.5),
    ("stops", "timed out after 2.", 3.5)])
def test_a_rank_that_leaves_ends_the_wait_with_an_error(tmp_path, how, said, within):
    outcome = tmp_path / "outcome"
    run_in_group(2, _a_rank_leaves, how, str(outcome))
    seconds, message = outcome.read_text().split(" ", 1)
    assert said in message
    assert float(seconds) < within


def _sizes_disagree(rank: int, world: int) -> None:
    shared = _attached()
    with pytest.raises(CollectiveError, match=r"the ranks copied in \[16, 20\] bytes"):
        shared.all_reduce(torch.ones(4 + rank))
    if rank == 0:  # the rank that reads the others' parts
        with pytest.raises(CollectiveError, match=r"the ranks copied in \[8, 12\] bytes"):
            shared.gather_to_first(torch.ones(2))
    else:
        assert shared.gather_to_first(torch.ones(3)) is None


def test_ranks_that_disagree_on_the_size_get_an_error_not_a_sum():
    run_in_group(2, _sizes_disagree)


def _copied_group(rank: int, world: int) -> None:
    group = comm.TensorGroup()
    group.share_memory()
    copy = pickle.loads(pickle.dumps(group))  # as a kept compiled graph's guards pickle it
    assert group.all_reduce_kind().startswith("shared memory") and copy.all_reduce_kind() == "gloo"
    parts = _inputs(world, (3, 8), torch.float32, 5)
    for each in (copy, group):
        assert torch.equal(each.all_reduce(parts[rank].clone()), _plain_sum(parts))


def test_a_pickled_copy_of_a_group_sums_through_gloo():
    """The mapping is the process's own: a copy leaves it out and still sums right."""
    run_in_group(2, _copied_group)


def _folder_missing(rank: int, world: int, folder: str) -> None:
    shared_memory.FOLDER = shared_memory.Path(folder)
    group = comm.TensorGroup()
    group.share_memory()
    assert group._shared is None
    kind = group.all_reduce_kind()
    assert kind.startswith("gloo (no shared memory: ") and "is not usable" in kind, kind
    parts = _inputs(world, (5, 8), torch.float32, 3)
    assert torch.equal(group.all_reduce(parts[rank].clone()), _plain_sum(parts))


def test_a_folder_that_cannot_be_used_keeps_gloo(tmp_path):
    run_in_group(2, _folder_missing, str(tmp_path / "missing"))


def test_the_all_reduce_bench_runs():
    """bench.all_reduce, as BENCHMARKS.md runs it (fewer calls): a row per size, both ways."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "bench.all_reduce", "--calls", "20"],
                          capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines() if " x 576 " in line]
    assert [(r[0], r[3]) for r in rows] == [("1", "bfloat16"), ("4", "bfloat16"),
                                            ("512", "float32"), ("2048", "float32")]
    assert all(float(v) > 0 for r in rows for v in r[4:8])
