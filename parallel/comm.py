"""Process groups and the few collectives the sharded layers need.

Every function works for a world of one (no process group at all), so the single-rank engine
runs exactly the same layer code as a tensor-parallel one.
"""
from __future__ import annotations

import datetime
import os
import socket
import time

import torch
import torch.distributed as dist

from parallel.trace import TRACER, nbytes, shape


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_process_group(master_addr: str, master_port: int, rank: int, world_size: int,
                       backend: str, timeout_s: float) -> None:
    """Join the group and prove it works with one warm-up all-reduce before any weights load."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group")
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


class _CollectiveClock:
    """Host time spent inside collectives since the last reset (exact on CPU; on CUDA it counts
    only the launch unless the caller synchronizes)."""

    seconds = 0.0

    @classmethod
    def take(cls) -> float:
        spent, cls.seconds = cls.seconds, 0.0
        return spent


def collective_seconds() -> float:
    """Seconds spent in collectives since the previous call."""
    return _CollectiveClock.take()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place. A no-op for a world of one."""
    if world_size() > 1:
        start = time.perf_counter()
        with TRACER.op("all_reduce", lambda: _all_reduce_cost(x), x.device):
            dist.all_reduce(x)
        _CollectiveClock.seconds += time.perf_counter() - start
    return x


def _all_reduce_cost(x: torch.Tensor) -> tuple[str, int, int]:
    """Ring all-reduce of n elements over w ranks: each rank does (w-1)·n/w additions and sends
    and receives 2(w-1)/w of the tensor's bytes."""
    w, n = world_size(), x.numel()
    return shape(x), (w - 1) * n // w, 2 * (w - 1) * n * x.element_size() // w


def gather_last_dim(x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
    """Concatenate each rank's slice of the last dim on rank 0 (None elsewhere).

    Slices may be uneven (`sizes[r]` columns on rank r): they are padded to the largest for the
    collective and trimmed after.
    """
    if world_size() == 1:
        return x
    width = max(sizes)
    padded = torch.nn.functional.pad(x, (0, width - x.shape[-1])).contiguous()
    parts = [torch.empty_like(padded) for _ in sizes] if rank() == 0 else None
    start = time.perf_counter()
    with TRACER.op("gather_logits", lambda: _gather_cost(padded, len(sizes)), x.device):
        dist.gather(padded, parts, dst=0)
    _CollectiveClock.seconds += time.perf_counter() - start
    if rank() != 0:
        return None
    return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)


def _gather_cost(part: torch.Tensor, parts: int) -> tuple[str, int, int]:
    """Rank 0 receives every rank's slice; the others send one."""
    return shape(part), 0, nbytes(part) * (parts if rank() == 0 else 1)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def node_ip() -> str:
    """The address other ranks of a group reach this node at (loopback when alone)."""
    return os.environ.get("PREFILL_NODE_IP") or socket.gethostbyname(socket.gethostname())
