"""A group of Ray actors, one per rank, joined in one torch.distributed process group.

The group knows nothing of any model: it places `world_size` actors of the worker class it is
given, mixed with the plumbing every rank needs (`_RankHost`); each actor joins the process group,
then runs the worker's constructor (`worker_class(*args, rank=r, world_size=n, **kwargs)`).
`launch(fn, *args)` then runs `fn(worker, *args)` on every rank at once (SPMD): a method of the
worker class as the actor's own method (`actor.execute.remote(batch)` is `Worker.execute`), any
other function through the host's `run`.

Every wait is bounded, so a dead or stuck rank becomes a `RankGroupError` (or the error type the
caller names in `GroupOptions.error`) instead of a hang:
- constructing: placement, joining the process group (with its warm-up all-reduce) and building the
  workers are each bounded by `init_timeout_s`; any failure tears the group down;
- `collect`: bounded by `step_timeout_s`. A dead actor or a timeout tears the group down (the other
  ranks would stay blocked in a collective). An exception raised by the worker on every rank is
  re-raised as itself (bad input, not a broken group) and the group stays usable; one raised on
  only some ranks is a `RankGroupError` and the group is left for the caller to shut down.

Actors import this module by name, so the repository must be importable in Ray workers: Ray puts
the driver's working directory on their `sys.path` (true for a local `ray.init`), or install it.
"""
from __future__ import annotations

import functools
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
    step_timeout_s: float = 30.0   # bound on any collect() waiting for results
    collective_timeout_s: float = 60.0  # torch.distributed's own bound on one collective
    # Set in each actor before the group forms, e.g. GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME.
    env: dict[str, str] = field(default_factory=dict)
    # Consecutive ranks that must share a node (a TP group); 0: all world_size ranks. Each such
    # block is one bundle of the placement group (see _place).
    ranks_per_node: int = 0
    node_ids: list[str] | None = None         # pin each block of ranks to this Ray node
    num_cpus: float = 1.0                     # logical CPUs per rank; fractions share cores
    # How a broken group is reported: the caller's own exception type, built from the message.
    error: Callable[[str], Exception] = field(default=lambda message: RankGroupError(message))


class RankGroupError(RuntimeError):
    """A rank died, hung or failed: the message names the rank, its node and what to do."""


class _RankHost:
    """The plumbing of one rank actor, mixed into the worker class (`_actor_class`): set the
    environment, join the process group, then run the worker's own constructor."""

    _worker_class: type  # set on the mixed class

    def __init__(self, env: dict[str, str]) -> None:
        os.environ.update(env)
        # comm.node_ip() falls back to the hostname's address, loopback on many hosts; Ray's node
        # address is the one other nodes reach this one at.
        os.environ.setdefault("PREFILL_NODE_IP", ray.util.get_node_ip_address())
        # Ranks of one group share a node's cores; one thread each avoids oversubscribing them.
        torch.set_num_threads(1)
        self._group_rank, self._group_size = 0, 1

    def describe(self) -> tuple[str, str]:
        return comm.node_ip(), ray.get_runtime_context().get_node_id()

    def pick_port(self, host: str) -> int:
        return comm.free_port(host)

    def join(self, addr: str, port: int, rank: int, world_size: int, backend: str,
             timeout_s: float) -> None:
        self._group_rank, self._group_size = rank, world_size
        comm.init_process_group(addr, port, rank, world_size, backend, timeout_s)

    def build(self, args: tuple, kwargs: dict) -> None:
        """The worker's constructor, run once the process group exists (it may use it)."""
        self._worker_class.__init__(self, *args, rank=self._group_rank,
                                    world_size=self._group_size, **kwargs)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self, *args)

    # "peer": calls from outside the group (another engine's ranks reading this one's data)
    # run on their own thread, beside the group's own calls, which stay one at a time, in order
    @ray.method(concurrency_group="peer")
    def run_beside(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`run`, but without waiting for the call in flight (a step can take seconds); only
        for functions safe to run beside any other (e.g. reading data no step writes)."""
        return fn(self, *args)

    def close(self) -> None:
        comm.destroy()


_HOST_NAMES = frozenset(name for name in vars(_RankHost) if not name.startswith("__"))


@functools.cache
def _actor_class(worker_class: type) -> Any:
    """The Ray actor class of one rank: `_RankHost` first, then the worker's own methods."""
    clash = _HOST_NAMES & set(dir(worker_class))
    if clash:
        raise TypeError(f"{worker_class.__name__} defines {sorted(clash)}, names the rank actor "
                        f"uses for its own plumbing; rename them in the worker class")
    mixed = type(f"{worker_class.__name__}Rank", (_RankHost, worker_class),
                 {"_worker_class": worker_class})
    return ray.remote(concurrency_groups={"peer": 1})(mixed)


class RankGroup:
    """`world_size` rank actors in one process group, each one a `worker_class` object."""

    def __init__(self, worker_class: type, options: GroupOptions, *args: Any,
                 **kwargs: Any) -> None:
        if options.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {options.world_size}")
        actor_class = _actor_class(worker_class)  # refuses a clashing worker before placing any
        self._options = options
        self._worker_class = worker_class
        self._pg: Any = None
        self._actors: list[Any] = []
        self._ips: list[str] = []
        self._node_ids: list[str] = []
        try:
            self._place()
            self._start_actors(actor_class)
            self._join()
            self._build(args, kwargs)
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

    def actors(self) -> list[Any]:
        """The rank actors, in rank order (e.g. for another group to call one directly)."""
        return list(self._actors)

    def launch(self, fn: Callable[..., Any], *args: Any) -> PendingCall:
        """Start `fn(worker, *args)` on every rank without waiting. A method of the worker class
        (`Worker.execute`) runs as the actor's own method; any other function runs through the
        host's `run` (define it at module level, so it travels by reference).

        Each argument is serialized once into the object store and every rank reads that copy.
        """
        if not self._actors:
            raise self._options.error("the rank group is shut down; create a new one")
        refs = [ray.put(arg) for arg in args]
        name = fn.__name__
        if getattr(self._worker_class, name, None) is fn:
            calls = [getattr(actor, name).remote(*refs) for actor in self._actors]
        else:
            calls = [actor.run.remote(fn, *refs) for actor in self._actors]
        return PendingCall(name, calls)

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
        selector = [{NODE_ID_LABEL_KEY: node} for node in opts.node_ids] if opts.node_ids else None
        self._pg = placement_group([dict(bundle) for _ in range(blocks)], strategy="PACK",
                                   bundle_label_selector=selector)
        ready, _ = ray.wait([self._pg.ready()], timeout=opts.init_timeout_s)
        if not ready:
            raise opts.error(_placement_advice(bundle, blocks, opts))

    def _start_actors(self, actor_class: Any) -> None:
        opts = self._options
        for rank in range(opts.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=rank // self._per_node)
            self._actors.append(actor_class.options(
                num_cpus=opts.num_cpus, num_gpus=1 if comm.is_cuda(opts.device) else 0,
                scheduling_strategy=strategy).remote(dict(opts.env)))
        out = _gather([a.describe.remote() for a in self._actors], opts.init_timeout_s)
        self._check(out, "failed to start its actor")
        self._ips = [ip for ip, _ in out.results]
        self._node_ids = [node for _, node in out.results]

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

    def _build(self, args: tuple, kwargs: dict) -> None:
        refs = [actor.build.remote(args, kwargs) for actor in self._actors]
        self._check(_gather(refs, self._options.init_timeout_s), "failed to build its worker",
                    "fix the worker class (its traceback is above) or raise init_timeout_s")

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
        if self._pg is not None:
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
