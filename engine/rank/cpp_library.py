"""C++ kernels compiled on first use, for the CPU they run on, and loaded with ctypes.

Each library is one C++ file beside its Python module, built with the machine's C++ compiler
(the one inductor's CPU code needs too) for this CPU (-march=native), kept under the engine's
cache folder by a hash of the source, compiler, CPU and torch, so later starts, and the other
ranks of a group (they wait while one builds), load it at once. Its OpenMP threads come from
the library torch already loaded. Where no compiler or build works, the library is simply
absent (one warning): its kernels are then not candidates, and the engine runs torch's
(engine.rank.kernel_choice).
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from engine.machine import cache_dir, cpu_description

log = logging.getLogger("engine")

FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")  # and -std, and -march: this CPU by default
# The CPU kind the kernels are built for, where not this one (tests build other kinds' code)
MARCH_ENV = "PREFILL_ENGINE_MARCH"


def torch_flags() -> tuple[str, ...]:
    """What a library of torch ops compiles and links with: torch's headers and libraries (the
    wheel ships both), its C++ standard and string ABI."""
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ("-std=c++20", f"-I{root / 'include'}",
            f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-L{root / 'lib'}", f"-Wl,-rpath,{root / 'lib'}")


TORCH_LIBRARIES = ("-lc10", "-ltorch_cpu")  # after the source: linkers drop those named before


class CompilerFailed(RuntimeError):
    """The compiler could not build the library (wherever it is put)."""


class CppLibrary:
    """One C++ source's library: `get()` builds it once per process (thread-safe) and returns it
    with its functions' argument types set, or None where it cannot be built or loaded."""

    def __init__(self, source: Path, name: str, signatures: dict[str, list], without: str,
                 register: str | None = None):
        """`name`: what the warning calls it; `signatures`: each exported function's ctypes
        argument types (all return an int status); `without`: what runs where it is absent;
        `register`: a library of torch ops (built against torch), and the exported function
        that registers their kernels, called once when the library loads."""
        self.source, self.name, self.signatures, self.without = source, name, signatures, without
        self.register = register
        self._lock = threading.Lock()
        self._loaded: list = []  # [the library, or None]: decided once

    def get(self) -> ctypes.CDLL | None:
        if self._loaded:  # decided: no lock (decode steps call kernels ~120 times each)
            return self._loaded[0]
        with self._lock:
            if not self._loaded:
                self._loaded.append(self._load())
            return self._loaded[0]

    def source_hash(self) -> str:
        """The source and the headers beside it, hashed: what the build and timings of its
        kernels (engine.rank.kernel_choice) hold for."""
        h = hashlib.sha256(self.source.read_bytes())
        for header in sorted(self.source.parent.glob("*.h")):
            h.update(header.read_bytes())
        return h.hexdigest()[:16]

    def _load(self) -> ctypes.CDLL | None:
        """From the cache folder, or, where that fails (a folder that cannot be written, a kept
        library that does not load), built afresh in a private temporary folder."""
        compiler = shutil.which(os.environ.get("CXX", "g++"))
        if compiler is None:
            log.warning("the %s is unavailable here (no C++ compiler: set CXX, or install g++); "
                        "%s", self.name, self.without)
            return None
        error = None
        for folder in (lambda: cache_dir() / "kernels", lambda: Path(tempfile.mkdtemp())):
            try:
                library = self.open(self.build(folder(), compiler))
                if self.register is not None and getattr(library, self.register)() != 0:
                    raise RuntimeError(f"{self.register}() failed")
                return library
            except (OSError, subprocess.SubprocessError, RuntimeError) as e:
                error = e
                if isinstance(e, CompilerFailed):
                    break  # it would fail the same way in another folder
        log.warning("the %s is unavailable here (%s); %s", self.name, error, self.without)
        return None

    def open(self, path: Path) -> ctypes.CDLL:
        """The built library at `path`, loaded, its functions' argument types set."""
        library = ctypes.CDLL(str(path))
        for function, argtypes in self.signatures.items():
            getattr(library, function).argtypes = argtypes
            getattr(library, function).restype = ctypes.c_int
        return library

    def build(self, folder: Path, compiler: str, march: str | None = None) -> Path:
        """The library for this source, compiler and CPU in `folder`: built once, kept, found by
        later starts. `march`: the CPU kind it is built for (default: $PREFILL_ENGINE_MARCH,
        else this CPU; tests build other kinds' code)."""
        march = march or os.environ.get(MARCH_ENV) or "native"
        asked = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
        if asked.returncode != 0:
            raise CompilerFailed(f"{compiler} --version failed: {asked.stderr.strip()[-300:]}")
        flags = (*FLAGS, f"-march={march}",
                 *(torch_flags() if self.register is not None else ("-std=c++17",)))
        # not the thread count (the kernel timings' key holds it): one build serves every rank
        key = hashlib.sha256("\0".join([self.source_hash(), asked.stdout, cpu_description(),
                                        f"torch {torch.__version__}", *flags]).encode())
        path = folder / f"{self.source.stem}-{key.hexdigest()[:16]}.so"
        if path.exists():
            return path
        folder.mkdir(parents=True, exist_ok=True)
        with _only_builder(folder) as alone:  # a group's ranks start at once: one compiles
            if not path.exists():
                if alone:  # no live builder of this folder but us: a partial is a dead one's
                    for partial in folder.glob(f"{path.stem}.*.tmp"):
                        partial.unlink(missing_ok=True)
                self._compile(compiler, flags, path)
        return path

    def _compile(self, compiler: str, flags: tuple[str, ...], path: Path) -> None:
        partial = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        # an OSError here, before the compiler runs, sends the build to another folder; the
        # linker's own failure to write would read as a compiler that cannot build it
        partial.write_bytes(b"")
        libraries = TORCH_LIBRARIES if self.register is not None else ()
        done = subprocess.run([compiler, *flags, str(self.source), "-o", str(partial), *libraries],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            raise CompilerFailed(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(partial, path)  # whole or absent to a reader that takes no lock


@contextlib.contextmanager
def _only_builder(folder: Path) -> Iterator[bool]:
    """Held by one process at a time for builds in `folder`: an exclusive lock on the folder
    itself (no file left behind), released by the kernel if its holder dies; yields whether
    it holds it. Where the folder takes no lock (some network file systems), builders run at
    once: each writes whole files, the same bytes."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
            locked = True
        except OSError:
            locked = False
        yield locked
    finally:
        os.close(handle)  # which releases the lock
