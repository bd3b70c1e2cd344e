"""compile=True graphs kept on disk whole: dynamo's traced code and guards with inductor's
compiled graph, so a later start loads each graph instead of tracing it again.

Inductor's caches alone keep only the compiled code: every start still ran dynamo over every
graph (tracing, guards, the cache lookups), 8-10 s of a SmolLM2 start on the AMX Xeon. A
graph precompiled with torch's `aot_compile` and saved loads in a fraction of a second.

A saved graph is the code it was traced from, frozen: its key names everything a trace read
besides its tensor inputs (the model's config, the engine's settings, the engine's own source
files, torch, the CPU), and a loaded graph's guards are checked before it runs, until its
owner trusts it (CompiledModel: a decode graph after one run through every layer). A graph
that cannot be loaded, or whose guards reject what it is called with, is compiled afresh by
torch.compile as usual.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger("engine")

# the packages whose code a graph traces: a change to any file in them is a new key
TRACED_PACKAGES = ("engine", "parallel")


@functools.cache
def source_digest() -> str:
    """A digest of the engine's own Python files, read once per process."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for package in TRACED_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def graph_file(folder: Path, name: str, key: str) -> Path:
    """Where graph `name` compiled under `key` is kept: named by the graph, its setup and its
    code (the engine's source, torch), so a graph compiled from newer code replaces the older
    one of the same setup (KeptGraph._compile) instead of piling up beside it."""
    setup = hashlib.sha256(key.encode()).hexdigest()[:16]
    code = hashlib.sha256(f"{source_digest()}|{torch.__version__}".encode()).hexdigest()[:16]
    return folder / f"{name}-{setup}-{code}.bin"


class KeptGraph:
    """A function compiled with torch.compile(fullgraph=True), kept on disk at `path` (None:
    in memory only, as plain torch.compile keeps it). `mark(args)` marks the dynamic sizes of
    a call's inputs: before every call of a graph dynamo compiles, before the first only of a
    kept one (a loaded graph's guards reject sizes marked after it was compiled)."""

    def __init__(self, fn: Callable, path: Path | None, mark: Callable | None = None,
                 **compile_options):
        self.compiled = torch.compile(fn, fullgraph=True, **compile_options)
        self.path, self._mark = path, mark or (lambda *args: None)
        self._kept = None  # the precompiled graph, once loaded or compiled
        self._trusted = False
        self.compiles = 0  # graphs compiled here (0: loaded from disk, or never run)
        self.fell_back = False  # a kept graph did not fit a call: plain torch.compile since

    def __call__(self, *args):
        if self.path is None or self.fell_back:  # plain torch.compile
            self._mark(*args)
            return self.compiled(*args)
        if self._kept is None:
            self._kept = self._load() or self._compile(args)
        if not self._trusted and not self._kept.guard_check(*args):
            if self.compiles == 0:  # loaded, and stale in a way its key missed: replace it
                self._kept = self._compile(args)
                return self(*args)
            log.warning("a graph compiled for %s does not fit this call; torch.compile "
                        "compiles it afresh, not kept", self.path.name)
            self.fell_back = True
            return self(*args)
        return self._kept.fn(*args)

    def trust(self) -> None:
        """Skip the guards from now on: every input the graph will see has passed them."""
        self._trusted = True

    def _load(self):
        try:
            with open(self.path, "rb") as f:
                return torch.compiler.load_compiled_function(f)
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001  a cut or stale file: compile afresh
            log.warning("could not load the compiled graph kept at %s (%s: %s); compiling it "
                        "again", self.path, type(e).__name__, str(e).splitlines()[0][:200])
            return None

    def _compile(self, args: tuple):
        self._mark(*args)
        kept = self.compiled.aot_compile((args, {}))
        self.compiles += 1
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # through a rename: ranks or engines of one setup starting together compile the
            # same graph, and one writing in place while another writes or reads it could
            # leave (or load) a mix of both files
            partial = self.path.with_name(
                f"{self.path.name}.{os.getpid()}.{threading.get_ident()}.partial")
            try:
                kept.save_compiled_function(str(partial))
                os.replace(partial, self.path)
            finally:
                partial.unlink(missing_ok=True)
            older = self.path.stem.rsplit("-", 1)[0]  # this graph and setup, other code
            for stale in self.path.parent.glob(f"{older}-*.bin"):
                if stale != self.path:
                    stale.unlink(missing_ok=True)
        except OSError as e:  # a read-only cache: the graph serves this run only
            log.info("could not keep a compiled graph at %s: %s", self.path, e)
        return kept
