"""Fake CUDA on a CPU-only torch: the engine's GPU path executed without a GPU.

Three parts, entered together by `fake_cuda()`:

1. **A device guard for CUDA.** torch's C++ bindings put a device guard around most tensor
   methods (`copy_`, indexing, `.to("cuda")`); a CPU-only build has no CUDA guard and fails with
   "not linked with support for cuda devices" before any fake tensor sees the call. c10 ships a
   do-nothing guard (`FakeGuardImpl`) for tests: a three-line library registers it for CUDA.
2. **FakeTensorMode** makes every `cuda` tensor a fake one (shape, dtype, device; no data) and
   raises `FakeTensorDeviceMismatchError` wherever a CPU and a CUDA tensor meet.
3. **`Recorder`**, a dispatch mode above it, keeps the host real: ops whose tensors are all on
   the host run for real, so the scheduler's lists, the sampler and the checkpoint reads behave
   as on a GPU machine. It records what a GPU would pay for: every host->device copy (pinned or
   not, blocking or not), every device->host copy (which hands back a real host tensor), every
   host sync (`.item()`/`.tolist()` on a device tensor: answered with 0 so the run goes on),
   every `torch.cuda` call the engine makes, and every Triton launch and autotuner benchmark
   (recorded, never run). Syncs and copies are tagged with the module forward they happen in,
   so a test can tell a sync inside the layers from the one the sampler needs.

Run it in a process of its own (the guard stays registered for the life of the process, and
Triton must not be in interpreter mode): `tests/fake_cuda_run.py` does, for `test_fake_cuda`.
"""
from __future__ import annotations

import contextlib
import hashlib
import subprocess
import traceback
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GUARD_SOURCE = """\
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
"""
aten = torch.ops.aten
GIB = 2**30


def load_cuda_guard(cache_dir: Path) -> None:
    """Build (once per torch version) and load the library registering c10's fake CUDA guard."""
    include = Path(torch.__file__).parent / "include"
    lib = Path(torch.__file__).parent / "lib"
    tag = hashlib.sha256((GUARD_SOURCE + torch.__version__).encode()).hexdigest()[:16]
    so = cache_dir / f"fake_cuda_guard_{tag}.so"
    if not so.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        src = cache_dir / f"fake_cuda_guard_{tag}.cpp"
        src.write_text(GUARD_SOURCE)
        tmp = so.with_suffix(".tmp.so")
        subprocess.run(["c++", "-shared", "-fPIC", "-std=c++17", "-O0", f"-I{include}", str(src),
                        f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}", "-o", str(tmp)], check=True)
        tmp.rename(so)
    torch.ops.load_library(str(so))


@dataclass
class Event:
    """One thing the GPU would have paid for."""

    kind: str  # "h2d", "d2h", "sync", "cuda:<function>", "launch", "autotune-bench"
    where: str  # the innermost module forward running, "" outside any
    detail: dict = field(default_factory=dict)


def _is_device(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


def _factory_device(kwargs: dict):
    dev = kwargs.get("device")
    return None if dev is None else torch.device(dev)


class Recorder(TorchDispatchMode):
    """Real host, fake device; see the module doc. Sits above (inside) a FakeTensorMode."""

    def __init__(self, fake: FakeTensorMode):
        super().__init__()
        self.fake = fake
        self.events: list[Event] = []
        self.module_stack: list[str] = []
        self._pinned: dict[int, weakref.ref] = {}  # by id: a tensor's == is elementwise
        self.host_values = 0  # what a device->host copy reads: zeros (argmax picks token 0)
        self.device_ms = 0.0  # the fake events' clock

    # -- what the tests read
    def where(self) -> str:
        return "/".join(self.module_stack)

    def record(self, kind: str, **detail) -> None:
        if kind == "sync":
            detail["stack"] = "".join(traceback.format_stack(limit=12)[:-2])
        self.events.append(Event(kind, self.where(), detail))

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]

    def mark(self) -> int:
        return len(self.events)

    def since(self, mark: int, kind: str | None = None) -> list[Event]:
        return [e for e in self.events[mark:] if kind is None or e.kind == kind]

    # -- the dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # composite ops (e.g. `to` under inference mode) reach a mode whole: take them apart so
        # their copies and syncs are seen as such
        if func.namespace == "aten" and func.has_kernel_for_dispatch_key(
                torch._C.DispatchKey.CompositeImplicitAutograd):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if func is aten._local_scalar_dense.default and _is_device(args[0]):
            self.record("sync", op="item")
            return 0
        if func is aten._pin_memory.default:
            self._pin(args[0])
            return args[0]
        if func is aten.is_pinned.default:
            return self.is_pinned(args[0])
        copy = self._crossing(func, args, kwargs)
        if copy is not None:
            return copy
        device_factory = _factory_device(kwargs)
        if any(isinstance(t, FakeTensor) for t in tensors) or (
                device_factory is not None and device_factory.type == "cuda"):
            return func(*args, **kwargs)
        # the host: real tensors, real work (a pinned factory is an ordinary one here)
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
            with unset_fake_temporarily():
                out = func(*args, **kwargs)
            self._pin(out)
            return out
        with unset_fake_temporarily():
            return func(*args, **kwargs)

    def _pin(self, t: torch.Tensor) -> None:
        self._pinned[id(t)] = weakref.ref(t)

    def is_pinned(self, t: torch.Tensor) -> bool:
        ref = self._pinned.get(id(t))
        return ref is not None and ref() is t

    def _faked(self, t: torch.Tensor) -> torch.Tensor:
        """A real host tensor as the fake mode's own (it would run ops on a real one for real)."""
        return t if isinstance(t, FakeTensor) else self.fake.from_tensor(t)

    def _crossing(self, func, args, kwargs):
        """A copy between host and device: recorded, then done (device->host hands back a real
        host tensor of zeros); None when `func` is not one."""
        if func is aten._to_copy.default:
            src, dst = args[0], _factory_device(kwargs)
            if dst is None or dst.type == src.device.type:
                return None
            if dst.type == "cuda":
                self.record("h2d", numel=src.numel(), pinned=self.is_pinned(src),
                            non_blocking=bool(kwargs.get("non_blocking")))
                return func(self._faked(src), *args[1:], **kwargs)
            self.record("d2h", numel=src.numel())
            with unset_fake_temporarily():
                return torch.full(src.shape, self.host_values, dtype=kwargs.get("dtype") or src.dtype)
        if func is aten.copy_.default and _is_device(args[0]) != _is_device(args[1]):
            dst, src = args[0], args[1]
            if _is_device(dst):
                self.record("h2d", numel=src.numel(), pinned=self.is_pinned(src), into=id(dst),
                            non_blocking=bool(args[2] if len(args) > 2
                                              else kwargs.get("non_blocking")))
                return func(dst, self._faked(src), *args[2:], **kwargs)
            self.record("d2h", numel=src.numel())
            with unset_fake_temporarily():
                return dst.fill_(self.host_values)
        return None


class _FakeEvent:
    """torch.cuda.Event: recorded; a fake device finishes everything at once."""

    def __init__(self, recorder: Recorder, enable_timing: bool = False, **_):
        self.recorder = recorder
        self.enable_timing = enable_timing

    def record(self, stream=None) -> None:
        # each record is 1 ms after the last on a virtual device clock, so timings add up
        self.recorder.device_ms += 1.0
        self.at_ms = self.recorder.device_ms
        self.recorder.record("cuda:Event.record")

    def synchronize(self) -> None:
        self.recorder.record("cuda:Event.synchronize")

    def wait(self, stream=None) -> None:
        self.recorder.record("cuda:Event.wait")

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_FakeEvent") -> float:
        return end.at_ms - self.at_ms


class _FakeStream:
    def __init__(self, recorder: Recorder, device=None, **_):
        self.recorder, self.device = recorder, device

    def wait_event(self, event) -> None:
        self.recorder.record("cuda:Stream.wait_event")

    def wait_stream(self, stream) -> None:
        self.recorder.record("cuda:Stream.wait_stream")

    def synchronize(self) -> None:
        self.recorder.record("cuda:Stream.synchronize")

    def record_event(self, event=None):
        event = event or _FakeEvent(self.recorder)
        event.record(self)
        return event


class _FakeGraph:
    """torch.cuda.CUDAGraph: capture and replay recorded (the work itself ran while captured)."""

    def __init__(self, recorder: Recorder):
        self.recorder = recorder

    def replay(self) -> None:
        self.recorder.record("cuda:graph.replay", graph=id(self))


@contextlib.contextmanager
def _fake_capture(recorder: Recorder, graph: _FakeGraph, pool=None, stream=None, **_):
    """torch.cuda.graph(...): everything recorded between the two marks ran under capture."""
    recorder.record("cuda:graph.capture_begin", graph=id(graph))
    yield
    recorder.record("cuda:graph.capture_end", graph=id(graph))


@dataclass
class FakeGpu:
    """What the fake machine reports: an H200's shape by default."""

    device_count: int = 1
    total_bytes: int = 141 * GIB
    free_bytes: int = 130 * GIB
    sms: int = 132
    name: str = "fake NVIDIA H200"


def _cuda_patches(rec: Recorder, gpu: FakeGpu) -> dict:
    """torch.cuda functions the engine calls, as recorders. set_device keeps torch's own
    argument check (a device without an index is refused, as on a real GPU)."""
    from torch.cuda._utils import _get_device_index

    state = {"current": 0}

    def set_device(device) -> None:
        index = _get_device_index(device)  # raises for torch.device("cuda"), as torch does
        if not 0 <= index < gpu.device_count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        state["current"] = index
        rec.record("cuda:set_device", index=index)

    def current_device() -> int:
        return state["current"]

    def synchronize(device=None) -> None:
        rec.record("cuda:synchronize")

    def mem_get_info(device=None) -> tuple[int, int]:
        rec.record("cuda:mem_get_info")
        return gpu.free_bytes, gpu.total_bytes

    def props(device=None):
        return SimpleNamespace(name=gpu.name, multi_processor_count=gpu.sms,
                               total_memory=gpu.total_bytes, major=9, minor=0)

    stream = _FakeStream(rec)
    return {
        "is_available": lambda: True, "device_count": lambda: gpu.device_count,
        "set_device": set_device, "current_device": current_device,
        "synchronize": synchronize, "mem_get_info": mem_get_info,
        "empty_cache": lambda: rec.record("cuda:empty_cache"),
        "get_device_properties": props, "get_device_name": lambda d=None: gpu.name,
        "max_memory_allocated": lambda d=None: 0, "memory_allocated": lambda d=None: 0,
        "Event": lambda **kw: _FakeEvent(rec, **kw), "Stream": lambda *a, **kw: _FakeStream(rec),
        "current_stream": lambda d=None: stream, "default_stream": lambda d=None: stream,
        "stream": lambda s: contextlib.nullcontext(s),
        "CUDAGraph": lambda: _FakeGraph(rec), "graph_pool_handle": lambda: ("pool",),
        "graph": lambda g, **kw: _fake_capture(rec, g, **kw),
    }


def _triton_patches(rec: Recorder) -> list:
    """Launches recorded with the integer specialisation Triton would compile for (its own
    rule), never run; the autotuner's benchmark answers at once, first config fastest."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction, native_specialize_impl

    def run(self, *args, grid, warmup, **kwargs):
        bound = dict(zip([p.name for p in self.params], args)) | kwargs
        spec, devices = [], set()
        for p in self.params:
            value = bound.get(p.name, p.default)
            if isinstance(value, torch.Tensor):
                devices.add(str(value.device))
                spec.append(str(value.dtype))
            elif isinstance(value, bool) or p.is_constexpr:
                spec.append(repr(value))
            elif isinstance(value, int):
                spec.append(repr(native_specialize_impl(
                    BaseBackend, value, False, not p.do_not_specialize,
                    not p.do_not_specialize_on_alignment)))
            else:
                spec.append(type(value).__name__)
        size = grid(bound) if callable(grid) else grid
        rec.record("launch", kernel=self.__name__, grid=tuple(size), devices=sorted(devices),
                   specialization=tuple(spec))

    def bench(self, *args, config, **kwargs):
        rec.record("autotune-bench", kernel=self.base_fn.__name__, config=str(config))
        return [float(self.configs.index(config))] * 3 if config in self.configs else [1e9] * 3

    return [mock.patch.object(JITFunction, "run", run),
            mock.patch.object(Autotuner, "_bench", bench)]


class _ModuleScopes:
    """Global forward hooks naming the module each op runs in (for `Event.where`)."""

    def __init__(self, rec: Recorder):
        self.rec = rec

    def __enter__(self):
        from torch.nn.modules import module as nn_module

        def pre(module, _args):
            self.rec.module_stack.append(type(module).__name__)

        def post(module, _args, _out):
            if self.rec.module_stack:
                self.rec.module_stack.pop()

        self.handles = [nn_module.register_module_forward_pre_hook(pre),
                        nn_module.register_module_forward_hook(post, always_call=True)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


@contextlib.contextmanager
def fake_cuda(cache_dir: Path, gpu: FakeGpu | None = None):
    """Yield a Recorder; inside, `cuda` tensors are fake and torch.cuda answers as `gpu`."""
    gpu = gpu or FakeGpu()
    load_cuda_guard(cache_dir)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    rec = Recorder(fake)
    patches = [mock.patch.object(torch.cuda, name, value)
               for name, value in _cuda_patches(rec, gpu).items()] + _triton_patches(rec)
    with contextlib.ExitStack() as stack:
        # entered while torch.cuda still says "no GPU": the mode then builds torch.tensor(...,
        # device="cuda") on the host and moves it as a fake (it would allocate on the device)
        stack.enter_context(fake)
        for p in patches:
            stack.enter_context(p)
        stack.enter_context(_ModuleScopes(rec))
        stack.enter_context(rec)
        yield rec
