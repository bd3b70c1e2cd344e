"""A group of Ray actors, one per rank, joined in one torch.distributed process group.

The group knows nothing of any model: it places `world_size` actors, makes them join a process
group, then builds `worker_factory(*args, rank=r, world_size=n, **kwargs)` inside each actor and
runs named methods of those workers on every rank at once (SPMD).

Every wait is bounded, so a dead or stuck rank becomes a `RankGroupError` (or the error type the
caller names in `GroupOptions.error`) instead of a hang:
- constructing: placement, joining the process group (with its warm-up all-reduce) and building the
  workers are each bounded by `init_timeout_s`; any failure tears the group down;
- `call`: bounded by `step_timeout_s`. A dead actor or a timeout tears the group down (the other
  ranks would stay blocked in a collective). An exception raised by the worker on every rank is
  re-raised as itself (bad input, not a broken group) and the group stays usable; one raised on
  only some ranks is a `RankGroupError` and the group is left for the caller to shut down.

Actors import this module by name, so the repository must be importable in Ray workers: Ray puts
the driver's working directory on their `sys.path` (true for a local `ray.init`), or install it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NoReturn

import ray
import torch
from ray.exceptions import RayTaskError
from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from parallel import comm
from parallel.ray.rank_waits import PendingCall, _Outcome, gather as _gather

# Closing is a courtesy before the kill: a rank that does not answer this fast is killed anyway.
_CLOSE_TIMEOUT_S = 5.0


@dataclass(slots=True)
class GroupOptions:
    world_size: int
    device: str = "cpu"            # "cpu" or "cuda"
    init_timeout_s: float = 60.0   # bound on each construction phase (placement, join, build)
    step_timeout_s: float = 30.0   # bound on any call() waiting for results
    collective_timeout_s: float = 60.0  # torch.distributed's own bound on one collective
    # Set in each actor before the group forms, e.g. GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME.
    env: dict[str, str] = field(default_factory=dict)
    # Consecutive ranks that must share a node (a TP group); 0: all world_size ranks. Each such
    # block is one bundle of the placement group (see _place).
    ranks_per_node: int = 0
    placement_group: object | None = None     # an existing ray PlacementGroup, one bundle per
                                              # block of ranks_per_node ranks, left to its owner
    node_ids: list[str] | None = None         # pin each block of ranks to this Ray node
    num_cpus: float = 1.0                     # logical CPUs per rank; fractions share cores
    # How a broken group is reported: the caller's own exception type, built from the message.
    error: Callable[[str], Exception] = field(default=lambda message: RankGroupError(message))


class RankGroupError(RuntimeError):
    """A rank died, hung or failed: the message names the rank, its node and what to do."""


# "peer": calls from outside the group (another engine's ranks reading this one's data) run on
# their own thread, beside the group's own calls, which stay one at a time and in order
@ray.remote(concurrency_groups={"peer": 1})
class _RankActor:
    """Hosts one rank: joins the process group, then builds and drives the worker."""

    def __init__(self, env: dict[str, str]) -> None:
        os.environ.update(env)
        # comm.node_ip() falls back to the hostname's address, loopback on many hosts; Ray's node
        # address is the one other nodes reach this one at.
        os.environ.setdefault("PREFILL_NODE_IP", ray.util.get_node_ip_address())
        # Ranks of one group share a node's cores; one thread each avoids oversubscribing them.
        torch.set_num_threads(1)
        self._rank = 0
        self._world_size = 1
        self._worker: Any = None

    def describe(self) -> tuple[str, str, int]:
        return comm.node_ip(), ray.get_runtime_context().get_node_id(), os.getpid()

    def pick_port(self, host: str) -> int:
        return comm.free_port(host)

    def join(self, addr: str, port: int, rank: int, world_size: int, backend: str,
             timeout_s: float) -> None:
        self._rank, self._world_size = rank, world_size
        comm.init_process_group(addr, port, rank, world_size, backend, timeout_s)

    def build(self, factory: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        self._worker = factory(*args, rank=self._rank, world_size=self._world_size, **kwargs)

    def invoke(self, method: str, payload: tuple[tuple, dict]) -> Any:
        args, kwargs = payload
        return getattr(self._worker, method)(*args, **kwargs)

    @ray.method(concurrency_group="peer")
    def invoke_beside(self, method: str, payload: tuple[tuple, dict]) -> Any:
        """`invoke`, but without waiting for the call in flight (a step can take seconds); only
        for worker methods safe to run beside any other (e.g. reading data no step writes)."""
        args, kwargs = payload
        return getattr(self._worker, method)(*args, **kwargs)

    def close(self) -> None:
        self._worker = None
        comm.destroy()


class RankGroup:
    """`world_size` rank actors in one process group, each holding one worker object."""

    def __init__(self, worker_factory: Callable[..., Any], options: GroupOptions,
                 *args: Any, **kwargs: Any) -> None:
        if options.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {options.world_size}")
        self._options = options
        self._owns_pg = options.placement_group is None
        self._pg: Any = options.placement_group
        self._actors: list[Any] = []
        self._ips: list[str] = []
        self._pids: list[int] = []
        self._node_ids: list[str] = []
        try:
            self._place()
            self._start_actors()
            self._join()
            self._build(worker_factory, args, kwargs)
        except BaseException:
            self._teardown(graceful=False)
            raise

    @property
    def world_size(self) -> int:
        return self._options.world_size

    def node_ips(self) -> list[str]:
        return list(self._ips)

    def node_ids(self) -> list[str]:
        """The Ray node id of each rank."""
        return list(self._node_ids)

    def pids(self) -> list[int]:
        return list(self._pids)

    def actors(self) -> list[Any]:
        """The rank actors, in rank order (e.g. for another group to call one directly)."""
        return list(self._actors)

    def launch(self, method: str, *args: Any, **kwargs: Any) -> PendingCall:
        """Start `worker.method(*args, **kwargs)` on every rank without waiting.

        The arguments are serialized once into the object store and every rank reads that copy.
        """
        if not self._actors:
            raise self._options.error("the rank group is shut down; create a new one")
        payload = ray.put((args, kwargs))
        return PendingCall(method, [actor.invoke.remote(method, payload) for actor in self._actors])

    def call(self, method: str, *args: Any, **kwargs: Any) -> list:
        """Run `worker.method(*args, **kwargs)` on every rank; the results in rank order."""
        return self.collect(self.launch(method, *args, **kwargs))

    def collect(self, pending: PendingCall) -> list:
        """The results of a `launch`, in rank order, waiting at most `step_timeout_s`."""
        method = pending.method
        out = _gather(pending.refs, self._options.step_timeout_s)
        failure = out.failure()
        if failure is None:
            return out.results
        if out.lost or out.pending:
            self._fail(failure, f"failed in {method}() (step_timeout_s="
                                f"{self._options.step_timeout_s})",
                       "The group was shut down; check that rank's log, then create a new group")
        if len(out.raised) == self.world_size and _same_kind(out.raised.values()):
            # Ray raises the worker's exception as a subclass of its own type: callers can catch it.
            raise out.raised[0]
        rank, why = failure
        raise self._options.error(f"rank {rank} (node {self._ips[rank]}) failed in {method}() while "
                             f"other ranks did not: {why}. Their states may differ: shut the "
                             f"group down")

    def shutdown(self) -> None:
        """Close the workers and the process group (briefly), then kill every actor. Idempotent."""
        self._teardown(graceful=True)

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def _per_node(self) -> int:
        return self._options.ranks_per_node or self._options.world_size

    def _place(self) -> None:
        """One bundle per block of `ranks_per_node` consecutive ranks, holding all of them.

        Ray reserves a bundle whole on one node, whatever the strategy: that, not the strategy,
        is what keeps a TP group on one node. Across bundles (the CP peers of a replica), PACK
        puts them on one node when it can hold them and spreads them otherwise; STRICT_PACK
        would refuse a replica larger than a node, STRICT_SPREAD two blocks on one node. With
        `node_ids` each bundle's label selector names its node and Ray only honours it.
        """
        opts, per = self._options, self._per_node
        if opts.world_size % per:
            raise ValueError(f"world_size={opts.world_size} is not a whole number of blocks of "
                             f"ranks_per_node={per}")
        blocks = opts.world_size // per
        if opts.node_ids is not None and len(opts.node_ids) != blocks:
            raise ValueError(f"node_ids names {len(opts.node_ids)} nodes for {blocks} blocks of "
                             f"{per} ranks")
        bundle = {"CPU": opts.num_cpus * per}
        if comm.is_cuda(opts.device):
            bundle["GPU"] = per
        if self._pg is None:
            selector = ([{NODE_ID_LABEL_KEY: node} for node in opts.node_ids]
                        if opts.node_ids else None)
            self._pg = placement_group([dict(bundle) for _ in range(blocks)], strategy="PACK",
                                       bundle_label_selector=selector)
        elif self._pg.bundle_count < blocks:
            raise ValueError(f"the placement group has {self._pg.bundle_count} bundles, fewer "
                             f"than the {blocks} blocks of {per} ranks")
        ready, _ = ray.wait([self._pg.ready()], timeout=opts.init_timeout_s)
        if not ready:
            raise opts.error(_placement_advice(bundle, blocks, opts))

    def _start_actors(self) -> None:
        opts = self._options
        for rank in range(opts.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=rank // self._per_node)
            self._actors.append(_RankActor.options(
                num_cpus=opts.num_cpus, num_gpus=1 if comm.is_cuda(opts.device) else 0,
                scheduling_strategy=strategy).remote(dict(opts.env)))
        out = _gather([a.describe.remote() for a in self._actors], opts.init_timeout_s)
        self._check(out, "failed to start its actor")
        self._ips = [ip for ip, _, _ in out.results]
        self._pids = [pid for _, _, pid in out.results]
        self._node_ids = [node for _, node, _ in out.results]

    def _join(self) -> None:
        opts = self._options
        # A group that lives on the driver's node alone listens on loopback only.
        driver_node = ray.get_runtime_context().get_node_id()
        local = all(node == driver_node for node in self._node_ids)
        addr = "127.0.0.1" if local else self._ips[0]
        port = self._rank0_port(addr)
        refs = [actor.join.remote(addr, port, rank, opts.world_size,
                                  comm.backend_for(opts.device), opts.collective_timeout_s)
                for rank, actor in enumerate(self._actors)]
        self._check(_gather(refs, opts.init_timeout_s),
                    f"failed to join the process group at {addr}:{port}",
                    "check the ranks can reach each other (set GLOO_SOCKET_IFNAME or "
                    "NCCL_SOCKET_IFNAME in GroupOptions.env) or raise init_timeout_s")

    def _rank0_port(self, addr: str) -> int:
        out = _gather([self._actors[0].pick_port.remote(addr)], self._options.init_timeout_s)
        self._check(out, f"could not pick a rendezvous port on {addr}")
        return out.results[0]

    def _build(self, factory: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        refs = [actor.build.remote(factory, args, kwargs) for actor in self._actors]
        self._check(_gather(refs, self._options.init_timeout_s), "failed to build its worker",
                    "fix the worker factory (its traceback is above) or raise init_timeout_s")

    def _check(self, out: _Outcome, what: str, advice: str = "check that rank's log") -> None:
        failure = out.failure()
        if failure is not None:
            self._fail(failure, what, f"The group was torn down; {advice}")

    def _fail(self, failure: tuple[int, str], context: str, advice: str) -> NoReturn:
        rank, why = failure
        node = self._ips[rank] if rank < len(self._ips) else "not yet known"
        self._teardown(graceful=False)
        raise self._options.error(f"rank {rank} (node {node}) {context}: {why}. {advice}")

    def _teardown(self, graceful: bool) -> None:
        actors, self._actors = self._actors, []
        if not ray.is_initialized():
            return
        if graceful and actors:
            _gather([actor.close.remote() for actor in actors], _CLOSE_TIMEOUT_S)
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if self._owns_pg and self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None


def _same_kind(errors: Iterable[RayTaskError]) -> bool:
    """Whether every rank failed with the same exception type (messages may name the rank)."""
    return len({type(err.cause) for err in errors}) == 1


def _placement_advice(bundle: dict[str, float], blocks: int, opts: GroupOptions) -> str:
    total, free = ray.cluster_resources(), ray.available_resources()
    have = ", ".join(f"{total.get(res, 0):g} {res} in total ({free.get(res, 0):g} free)"
                     for res in bundle)
    wanted = " + ".join(f"{n:g} {res}" for res, n in bundle.items())
    where = f" on node(s) {sorted(set(opts.node_ids))}" if opts.node_ids else ""
    return (f"could not place {opts.world_size} ranks within {opts.init_timeout_s} s: asked for "
            f"{blocks} x ({wanted}), each on one node{where}; the cluster has {have}; lower "
            f"world_size, free resources or add nodes")
