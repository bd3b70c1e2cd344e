"""Process groups and the few collectives the sharded layers need (`TensorGroup`)."""
from __future__ import annotations

import datetime
import os
import socket
import time

import torch
import torch.distributed as dist

from parallel import graph_op
from parallel.shared_memory import SharedMemoryCollectives

# the bound on one collective the process group was made with (init_process_group), which the
# shared-memory sums keep too
_collective_timeout_s = 60.0
# the integer dtypes shared memory sums (floats too; bool and complex go through torch.distributed)
_INTEGERS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def backend_for(device: str) -> str:
    return "nccl" if is_cuda(device) else "gloo"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_process_group(master_addr: str, master_port: int, rank: int, world_size: int,
                       backend: str, timeout_s: float) -> None:
    """Join the group and prove it works with one warm-up all-reduce before any weights load."""
    global _collective_timeout_s
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group")
    _collective_timeout_s = timeout_s
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    if int(probe.item()) != world_size:
        raise RuntimeError(f"warm-up all-reduce gave {probe.item()}, expected {world_size}")


class CollectiveClock:
    """Seconds spent in collectives by this process, only ever growing: a caller reads it before
    and after a step and takes the difference.

    `seconds` is the *exposed* time: the rank blocked, waiting on a collective. `busy_seconds`
    is the *total* time collectives were in flight, start to finish, whether or not the rank
    computed meanwhile. A blocking collective adds the same to both; an overlapped one
    (`all_reduce_async`) adds its whole flight to `busy_seconds` and only the wait to `seconds`.

    On a CPU (gloo) both are host time. On CUDA the host only enqueues NCCL work, so host time
    would read ~0: a collective there is timed with CUDA events on the compute stream (the
    stream's wait on it is the exposed time), and `settle()` turns the recorded spans into
    seconds once the device has run them (after the step's synchronize).
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.busy_seconds = 0.0
        self._spans: list[tuple] = []  # CUDA events: (flight start, wait start, end)

    def add_since(self, start: float) -> None:
        spent = time.perf_counter() - start
        self.seconds += spent
        self.busy_seconds += spent

    def add_device_span(self, flight_start, wait_start, end) -> None:
        self._spans.append((flight_start, wait_start, end))

    def settle(self) -> None:
        """Add the recorded CUDA spans; call once the device has finished them."""
        for flight_start, wait_start, end in self._spans:
            self.seconds += wait_start.elapsed_time(end) / 1e3
            self.busy_seconds += flight_start.elapsed_time(end) / 1e3
        self._spans.clear()

    def discard(self) -> None:
        """Drop the recorded spans unread (a rank whose step time nobody reads)."""
        self._spans.clear()


def device_event(x: torch.Tensor):
    """A timing event recorded now on the current CUDA stream; None for a host tensor."""
    if not x.is_cuda:
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def is_cuda(device: str | torch.device) -> bool:
    """The one test of "does this run on a GPU" that the whole code base uses."""
    return str(device).startswith("cuda")


class TensorGroup:
    """A rank's tensor-parallel group, the collectives the sharded layers run over it, and the
    clock of their time. Every method works for a world of one (no process group at all), so
    the single-rank engine runs exactly the same layer code as a tensor-parallel one.

    `group`: a sub-group from dist.new_group (a replica that also splits by context), or None:
    the whole process group. Each rank builds one and hands it to every layer of its model."""

    def __init__(self, group=None):
        self.group = group
        self.clock = CollectiveClock()
        # the name a compiled graph's all-reduce finds this group by; registered here, never
        # inside a traced forward (dynamo cannot trace writing the registry)
        self.name = _register(self) if self.world_size() > 1 else ""
        self._shared: SharedMemoryCollectives | None = None
        self._not_shared = ""  # why share_memory() kept torch.distributed's all-reduce

    def share_memory(self) -> None:
        """Collective over the group: CPU tensors are summed and gathered through memory the
        ranks share (parallel.shared_memory) where they can map it, else as before, by
        torch.distributed. Every rank of the group calls it, or none."""
        if self.world_size() > 1:
            self._shared, self._not_shared = SharedMemoryCollectives.attach(
                self.group, _collective_timeout_s)

    def __getstate__(self) -> dict:
        """A copy (a compiled graph kept on disk pickles its guards, which hold the layers and
        so this group) leaves the shared memory out: the mapping is this process's. Graphs
        reach the live group by its name at run time."""
        return {**self.__dict__, "_shared": None}

    def all_reduce_kind(self) -> str:
        """How `all_reduce` sums this rank's tensors, for rank_info."""
        if self.world_size() == 1:
            return "none (one rank)"
        backend = dist.get_backend(self.group)
        if self._shared is not None:
            return f"shared memory (CPU tensors; {backend} otherwise)"
        return backend + (f" (no shared memory: {self._not_shared})" if self._not_shared else "")

    def through_shared_memory(self, x: torch.Tensor) -> bool:
        """Whether this group's collectives move x through shared memory (else
        torch.distributed's)."""
        return (self._shared is not None and x.device.type == "cpu"
                and (x.dtype.is_floating_point or x.dtype in _INTEGERS))

    def world_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place. A no-op for a world of one."""
        if self.world_size() > 1:
            start, event = time.perf_counter(), device_event(x)
            if self.through_shared_memory(x):
                self._shared.all_reduce(x)
            else:
                dist.all_reduce(x, group=self.group)
            self._add_blocking(start, event, x)
        return x

    def all_reduce_in_graph(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks into a new tensor, as a custom op a compiled graph can hold (an
        op there may not hand back its own input); it finds this group by its name."""
        if self.world_size() == 1:
            return x
        return all_reduce_copy(x, self.name)

    def _add_blocking(self, start: float, event, x: torch.Tensor) -> None:
        """A blocking collective begun at host time `start` (and CUDA event `event`) ended."""
        if event is None:
            self.clock.add_since(start)
        else:  # the compute stream waited on it from the start: all of it is exposed
            self.clock.add_device_span(event, event, device_event(x))

    def all_reduce_async(self, x: torch.Tensor) -> PendingAllReduce:
        """Start a sum over ranks in place and return at once (gloo runs it on its own
        threads, NCCL on its own stream); the caller computes something else, then waits."""
        if self.world_size() == 1:
            return PendingAllReduce(x, None, 0.0, self.clock)
        start, event = time.perf_counter(), device_event(x)
        if self.through_shared_memory(x):
            work = SharedWork(self._shared, x)
        else:
            work = dist.all_reduce(x, group=self.group, async_op=True)
        return PendingAllReduce(x, work, start, self.clock, event)

    def gather_last_dim(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """Concatenate each rank's slice of the last dim on rank 0 (None elsewhere). Slices
        may be uneven (`sizes[r]` columns on rank r): padded to the largest for the collective
        and trimmed after."""
        if self.world_size() == 1:
            return x
        width = max(sizes)
        padded = torch.nn.functional.pad(x, (0, width - x.shape[-1])).contiguous()
        first = self.rank() == 0
        start, event = time.perf_counter(), device_event(padded)
        if self.through_shared_memory(padded):
            parts = self._shared.gather_to_first(padded)
        else:
            parts = [torch.empty_like(padded) for _ in sizes] if first else None
            dist.gather(padded, parts, group=self.group, group_dst=0)
        self._add_blocking(start, event, padded)
        if not first:
            return None
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)


# the groups compiled graphs reach by name (a custom op takes strings, not objects); a
# registry of process groups like torch.distributed's own, written once per group
_BY_NAME: dict[str, TensorGroup] = {}


def _register(group: TensorGroup) -> str:
    name = f"tp{len(_BY_NAME)}"
    _BY_NAME[name] = group
    return name


def _all_reduce_copy(x: torch.Tensor, group: str) -> torch.Tensor:
    return _BY_NAME[group].all_reduce(x.clone())


all_reduce_copy = graph_op.define("all_reduce(Tensor x, str group) -> Tensor", _all_reduce_copy,
                                  lambda x, group: torch.empty_like(x))


class SharedWork:
    """A shared-memory sum begun by `TensorGroup.all_reduce_async`: x is copied in at once where
    it fits one slot (the other ranks need not wait for this one), summed at `wait()`."""

    def __init__(self, shared: SharedMemoryCollectives, x: torch.Tensor):
        self._shared, self._x = shared, x
        self._started = shared.start(x)

    def wait(self) -> None:
        if self._started:  # a later call may have summed it already
            self._shared.finish_pending()
        else:
            self._shared.all_reduce(self._x)


class PendingAllReduce:
    """An all-reduce in flight; `wait()` returns the summed tensor (the same storage)."""

    def __init__(self, x: torch.Tensor, work, start: float, clock: CollectiveClock,
                 start_event=None):
        self.x, self._work, self._start, self._start_event = x, work, start, start_event
        self._clock = clock
        self._done_at: float | None = None
        if work is not None and start_event is None and not isinstance(work, SharedWork):
            # the completion time, taken on the communication thread, measures the flight
            work.get_future().then(self._mark_done)

    def _mark_done(self, _future) -> None:
        self._done_at = time.perf_counter()

    def wait(self) -> torch.Tensor:
        if self._work is None:
            return self.x
        if self._start_event is not None:  # CUDA: the compute stream's wait is the exposed part
            before = device_event(self.x)
            self._work.wait()
            self._clock.add_device_span(self._start_event, before, device_event(self.x))
            self._work = None
            return self.x
        before = time.perf_counter()
        self._work.wait()
        after = time.perf_counter()
        self._clock.seconds += after - before
        # the callback may not have run yet when wait() returns: then "now" bounds it
        self._clock.busy_seconds += (self._done_at or after) - self._start
        self._work = None
        return self.x


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def node_ip() -> str:
    """The address other ranks of a group reach this node at (loopback when alone)."""
    return os.environ.get("PREFILL_NODE_IP") or socket.gethostbyname(socket.gethostname())
