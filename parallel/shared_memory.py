"""An all-reduce (and a gather) through shared memory, for CPU ranks of one group on one machine.

gloo sums over TCP loopback: a median 430 us for one decode row of SmolLM2 ([1, 576] bf16)
between two ranks of the AVX512-BF16 EPYC, a mean of 1.7 ms (waits of several ms now and then),
and a layer makes two of them; through shared memory 18 us (`.venv/bin/python -m
bench.all_reduce`, BENCHMARKS.md). A tp=2 engine's 4-bit decode ran 11.9 tok/s through gloo and
77.2 through memory (`bench.tp_scaling`, same page). Here each rank copies its tensor into its
own slot of a mapped file and raises its counter; once every rank's counter has reached the
call, each rank sums every slot, in rank order, into its tensor: the same sum on every rank,
with no message in between.

Slots come in two sets, used by turns, so a call's copy-in never overwrites a slot a slower rank
is still summing: each rank also counts the calls it has finished summing, and a copy-in waits
for every rank to have finished the call before the last (one call in flight at a time; a new
call finishes an unfinished one first). A tensor larger than a slot goes through in pieces.

Waiting spins briefly, then yields its core: ranks often outnumber a small machine's spare cores.
A wait ends with an error when a rank's process is gone, or after the group's collective timeout
(a stopped rank): what gloo's own timeout did. Where memory is not shared (ranks on different
machines, no room in /dev/shm, a CPU other than x86), `SharedMemoryCollectives.attach` returns
None with the reason, and the group keeps torch.distributed's collectives.
"""
from __future__ import annotations

import mmap
import os
import platform
import secrets
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

FOLDER = Path("/dev/shm")
SLOT_BYTES = 2 * 2**20  # per rank and set: decode rows fit whole, a long prompt's go in pieces
SETS = 2
LINE = 64  # each rank's counters on a cache line of their own
# a rank's line: [0] calls copied in, [1] calls summed, [2] its pid, [3] its proof of sharing,
# [4 + set] the bytes it copied into that set's slot
COPIED, SUMMED, PID, PROOF, BYTES = range(5)
HOT_S = 200e-6  # a wait polls this long before it starts yielding its core
LIVENESS_S = 0.5  # how often a long wait looks for vanished ranks


class CollectiveError(RuntimeError):
    """A shared-memory all-reduce could not finish: a rank exited or stopped answering."""


class SharedMemoryCollectives:
    """The sums of one process group's CPU ranks through a file mapped by all of them."""

    def __init__(self, mapping: mmap.mmap, rank: int, world: int, timeout_s: float,
                 pids_visible: bool):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        # whether this process sees the others' pids (one pid namespace): a wait then notices
        # a rank that exited, else only the timeout ends it
        self._pids_visible = pids_visible
        self._map = mapping
        words = world * LINE // 8
        self._lines = np.frombuffer(mapping, dtype=np.int64, count=words).reshape(world, LINE // 8)
        self._data = torch.frombuffer(mapping, dtype=torch.uint8, offset=world * LINE,
                                      count=SETS * world * SLOT_BYTES).view(SETS, world, SLOT_BYTES)
        self._counters = {c: self._lines[:, c] for c in (COPIED, SUMMED)}  # every rank's
        self._views: dict[tuple, tuple] = {}  # (set, bytes, dtype) -> the slots' views
        self._calls = 0  # calls begun by this rank: the next one's number is _calls + 1
        self._pending: tuple[int, torch.Tensor] | None = None  # copied in, not yet summed

    @classmethod
    def attach(cls, group, timeout_s: float) -> tuple[SharedMemoryCollectives | None, str]:
        """Collective over `group` (None: the whole world): every rank maps one file that the
        group's first rank creates, and proves it sees the others' writes. Returns (the sums,
        "") or (None, why not) on every rank alike."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        made, path, why = _open_mapping(group, rank, world)
        mine, lines = (secrets.randbits(62), os.getpid()), None
        if made is not None:
            lines = np.frombuffer(made, dtype=np.int64, count=world * LINE // 8)
            lines[rank * LINE // 8 + PROOF], lines[rank * LINE // 8 + PID] = mine
        theirs = [None] * world
        dist.all_gather_object(theirs, mine if made is not None else None, group=group)
        if made is not None and None not in theirs:
            seen = [int(lines[r * LINE // 8 + PROOF]) for r in range(world)]
            if seen != [proof for proof, _ in theirs]:
                why = "the ranks' writes to /dev/shm are not shared (different machines)"
        ok = torch.tensor([0 if why else 1])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # every rank has mapped it
        if rank == 0 and path is not None:  # the mappings stay; no file outlives the ranks
            path.unlink(missing_ok=True)
        del lines  # a buffer exported from the mapping would keep it from closing
        if int(ok) == 0:
            if made is not None:
                made.close()
            return None, why or "another rank of the group could not share memory"
        pids_visible = all(_alive(pid) for _, pid in theirs)
        return cls(made, rank, world, timeout_s, pids_visible), ""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        self.finish_pending()
        flat = _flat_bytes(x)
        for start in range(0, len(flat), SLOT_BYTES):
            piece = flat[start:start + SLOT_BYTES]
            call = self._copy_in(piece)
            self._sum_into(call, piece, x.dtype)
        _copy_back(x, flat)
        return x

    def start(self, x: torch.Tensor) -> bool:
        """Copy x in now and sum it at `finish_pending` (True), so the other ranks can go on;
        False where it does not fit one slot (the caller sums it whole later)."""
        self.finish_pending()
        flat = _flat_bytes(x)
        if len(flat) > SLOT_BYTES:
            return False
        self._pending = (self._copy_in(flat), x)
        return True

    def finish_pending(self) -> None:
        """Sum the started call into its tensor (nothing if none is started)."""
        if self._pending is None:
            return
        (call, x), self._pending = self._pending, None
        flat = _flat_bytes(x)
        self._sum_into(call, flat, x.dtype)
        _copy_back(x, flat)

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x (each of x's shape and dtype) on the group's first rank, in rank
        order; None on the others, which go on once theirs is copied in."""
        self.finish_pending()
        flat, first = _flat_bytes(x), self.rank == 0
        outs = [torch.empty_like(flat) for _ in range(self.world)] if first else []
        for start in range(0, len(flat), SLOT_BYTES):
            piece = flat[start:start + SLOT_BYTES]
            call = self._copy_in(piece)
            if first:
                self._read_ready(call, len(piece))
                for out, part in zip(outs, self._slot_views(call % SETS, len(piece), torch.uint8)):
                    out[start:start + len(piece)].copy_(part)
            # done with the call's set: the first rank once it has read it, others at once
            self._lines[self.rank, SUMMED] = call
        return [out.view(x.dtype).view(x.shape) for out in outs] if first else None

    def close(self) -> None:
        self._pending = None
        self._views.clear()  # views of the mapping keep it from closing
        del self._counters, self._lines, self._data
        self._map.close()

    def _copy_in(self, piece: torch.Tensor) -> int:
        """This rank's bytes into its slot of the call's set; returns the call's number."""
        call = self._calls + 1
        # the set was last used by call - SETS: every rank must have summed it
        self._wait(SUMMED, call - SETS, "finish the call before")
        self._slot_views(call % SETS, len(piece), torch.uint8)[self.rank].copy_(piece)
        self._lines[self.rank, BYTES + call % SETS] = len(piece)
        self._lines[self.rank, COPIED] = call  # after the bytes (x86 stores stay in order)
        self._calls = call
        return call

    def _sum_into(self, call: int, flat: torch.Tensor, dtype: torch.dtype) -> None:
        self._read_ready(call, len(flat))
        parts = self._slot_views(call % SETS, len(flat), dtype)
        # in rank order on every rank: every rank gets the same sum. Half-precision parts are
        # summed in float32 and rounded once (as torch adds two of them)
        if len(parts) == 2:
            torch.add(parts[0], parts[1], out=flat.view(dtype))
        else:
            total = parts[0].float() if dtype.itemsize < 4 else parts[0].clone()
            for part in parts[1:]:
                total += part
            flat.view(dtype).copy_(total)
        self._lines[self.rank, SUMMED] = call

    def _read_ready(self, call: int, size: int) -> None:
        """Wait until every rank has copied its part of `call` in, and check that each copied
        `size` bytes: ranks that disagree (a bug elsewhere) get an error, not a sum of whatever
        lies past the shorter parts."""
        self._wait(COPIED, call, "copy its tensor in")
        sizes = self._lines[:, BYTES + call % SETS]
        if (sizes != size).any():
            raise CollectiveError(
                f"shared-memory collective {call}: the ranks copied in {sizes.tolist()} bytes; "
                f"every rank must call each collective with a tensor of the same size")

    def _slot_views(self, which: int, size: int, dtype: torch.dtype) -> tuple:
        """Each rank's slot of set `which`, its first `size` bytes as `dtype`: kept, as a decode
        step asks for the same few again and again. Made outside inference mode: a view made
        inside it could not be written outside it, where other steps run."""
        key = (which, size, dtype)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 64:  # a prompt's many sizes: keep the recent ones
                self._views.clear()
            with torch.inference_mode(False):
                slots = self._data[which, :, :size]
                views = tuple(slots[r].view(dtype) for r in range(self.world))
            self._views[key] = views
        return views

    def _wait(self, column: int, call: int, what: str) -> None:
        """Until every rank's `column` counter reaches `call`."""
        counters = self._counters[column]
        if counters.min() >= call:
            return
        started = checked = time.monotonic()
        while counters.min() < call:
            now = time.monotonic()
            if now - started < HOT_S:
                continue
            os.sched_yield()
            if now - checked > LIVENESS_S:
                checked = now
                self._check_ranks(column, call, what, now - started)

    def _check_ranks(self, column: int, call: int, what: str, waited: float) -> None:
        late = [r for r in range(self.world) if self._lines[r, column] < call]
        gone = [r for r in late if self._pids_visible and not _alive(int(self._lines[r, PID]))]
        if gone:
            raise CollectiveError(
                f"shared-memory all-reduce: rank(s) {gone} of this group exited before they "
                f"could {what} (call {call})")
        if waited > self.timeout_s:
            raise CollectiveError(
                f"shared-memory all-reduce timed out after {waited:.1f} s (collective_timeout_s="
                f"{self.timeout_s:g}) waiting for rank(s) {late} to {what} (call {call}): "
                f"stopped or stuck")


def _open_mapping(group, rank: int, world: int) -> tuple[mmap.mmap | None, Path | None, str]:
    """The group's first rank creates the file and tells the others its name; every rank maps it.
    Returns (the mapping, the file, ""), or (None, the file or None, why) on a rank that cannot."""
    size = world * LINE + SETS * world * SLOT_BYTES
    made = [_create_file(size) if rank == 0 else None]  # (the file or None, why not)
    dist.broadcast_object_list(made, group=group, group_src=0)
    path, why = made[0]
    if path is None:
        return None, None, why
    try:
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                return None, path, f"{path} is not the first rank's file (different machines)"
            return mmap.mmap(fd, size), path, ""
        finally:
            os.close(fd)
    except OSError as e:
        return None, path, f"{path} cannot be mapped here: {e} (different machines?)"


def _create_file(size: int) -> tuple[Path | None, str]:
    """The group's file of `size` bytes, its pages reserved (a full /dev/shm fails here, not as
    a SIGBUS mid-step), or (None, why not)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, ("the sums rely on x86's store order (a counter raised after the bytes it "
                      f"counts is seen after them), and this is {platform.machine()}")
    path = FOLDER / f"prefill-all-reduce-{os.getpid()}-{secrets.token_hex(8)}"
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
    except OSError as e:
        path.unlink(missing_ok=True)
        return None, f"{FOLDER} is not usable for the all-reduce: {e}"
    return path, ""


def _flat_bytes(x: torch.Tensor) -> torch.Tensor:
    """x's bytes as a flat uint8 view (of a contiguous copy where x is not contiguous)."""
    dense = x if x.is_contiguous() else x.contiguous()
    return dense.view(-1).view(torch.uint8)


def _copy_back(x: torch.Tensor, flat: torch.Tensor) -> None:
    """Where x was not contiguous its sum went to a copy: back into x."""
    if not x.is_contiguous():
        x.copy_(flat.view(x.dtype).view(x.shape))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process, alive
        return True
    return True
