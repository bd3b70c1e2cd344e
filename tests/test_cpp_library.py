"""engine.rank.cpp_library's builds: one per source, compiler and CPU, whatever the thread count
of the process that asks (a tp=2 group's ranks run one thread each, a tp=1 engine two), and one
compile when several processes or threads ask for it at once (a group's ranks start together);
kept for the next start, and built elsewhere where the cache cannot hold or load it. A one-line
library stands in for the engine's (each takes 10-20 s to compile): the build is the same code."""
from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch

from engine.rank.cpp_library import CppLibrary

SOURCE = 'extern "C" int answer() { return 42; }\n'


def answer_library(folder: Path) -> CppLibrary:
    """A library of the one-line source in `folder` (a new object: a new process's view)."""
    source = folder / "answer.cpp"
    if not source.exists():
        folder.mkdir(parents=True, exist_ok=True)
        source.write_text(SOURCE)
    return CppLibrary(source, "answer", {"answer": []}, "nothing")


@pytest.fixture
def library(tmp_path) -> CppLibrary:
    return answer_library(tmp_path / "src")


@pytest.fixture
def counted_compiler(tmp_path) -> tuple[str, Path]:
    """A compiler that logs each compile (not `--version`) and takes a second over it, so two
    builders that do not wait for each other overlap."""
    log, script = tmp_path / "compiles.log", tmp_path / "cxx"
    script.write_text(f'#!/bin/sh\ncase "$1" in --version) ;; *) echo x >> {log}; sleep 1 ;; esac\n'
                      f'exec {shutil.which("g++")} "$@"\n')
    script.chmod(0o755)
    return str(script), log


def _compiles(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_a_build_serves_every_thread_count(library, counted_compiler, tmp_path):
    compiler, log = counted_compiler
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = library.build(tmp_path / "kernels", compiler)
        torch.set_num_threads(2)
        two = library.build(tmp_path / "kernels", compiler)
    finally:
        torch.set_num_threads(before)
    assert one == two and _compiles(log) == 1
    assert library.open(two).answer() == 42


def test_builders_at_once_compile_once(library, counted_compiler, tmp_path):
    compiler, log = counted_compiler
    built: list[Path] = []

    def build() -> None:
        built.append(library.build(tmp_path / "kernels", compiler))
    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(built) == 3 and len(set(built)) == 1
    assert _compiles(log) == 1
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [built[0].name]  # nothing else
    assert library.open(built[0]).answer() == 42


def test_a_dead_builders_partial_file_is_removed_by_the_next_build(library, tmp_path):
    """The partial file of a builder that died (a killed rank) is removed by the next build of
    the same library, which alone holds the folder then."""
    folder = tmp_path / "kernels"
    path = library.build(folder, "g++")
    path.unlink()
    dead = folder / f"{path.stem}.4194305.1.tmp"  # past Linux's highest pid: no live builder's
    dead.write_bytes(b"half a library")
    assert library.build(folder, "g++") == path
    assert [p.name for p in folder.iterdir()] == [path.name]


def test_a_kept_folder_that_takes_no_file_builds_it_elsewhere(library, tmp_path, monkeypatch):
    """A kernels folder that exists but cannot be written (a read-only mount of a cache kept
    for another CPU; Linux's /proc folders, which the engine's CPU checks read too, are
    read-only even to root): the library is built in a private temporary folder and loads."""
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to("/proc/self/fdinfo", target_is_directory=True)
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(tmp_path / "cache"))
    built = library.get()
    assert built is not None and built.answer() == 42


def test_a_build_is_kept_and_found_by_the_next_start(counted_compiler, tmp_path, monkeypatch):
    compiler, log = counted_compiler
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", compiler)
    assert answer_library(tmp_path / "src").get().answer() == 42
    [kept] = (tmp_path / "cache" / "kernels").iterdir()  # the library, no leftovers
    assert kept.suffix == ".so"
    mtime = kept.stat().st_mtime_ns
    assert answer_library(tmp_path / "src").get().answer() == 42  # the next start's
    assert _compiles(log) == 1 and kept.stat().st_mtime_ns == mtime


@pytest.mark.parametrize("damage", ["an unwritable cache", "a kept library that does not load"])
def test_a_damaged_cache_builds_it_elsewhere(library, tmp_path, monkeypatch, damage):
    """The cache folder cannot take the library (a file where its parent should be), or holds
    a broken one: the library is built in a private temporary folder instead, and loads."""
    if damage == "an unwritable cache":
        (tmp_path / "a_file").write_text("")
        cache = tmp_path / "a_file" / "cache"
    else:
        cache = tmp_path / "cache"
        library.build(cache / "kernels", "g++").write_bytes(b"not a library")
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(cache))
    built = library.get()
    assert built is not None and built.answer() == 42
    assert not Path(built._name).is_relative_to(tmp_path)  # elsewhere: not the cache, nor beside it
