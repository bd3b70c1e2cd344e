"""Run a command the way a person would, in its own session, and leave nothing of it behind.

Every command runs as the leader of a new session (`start_new_session=True`). Ray's processes
(GCS, raylet, agents, workers; workers get their own process groups) stay in that session, so
"what this command left running" is exactly "the live processes whose session id is its pid".
After the command exits they get a short grace period to go, then are killed and reported.
This never touches a Ray that someone else started on this machine, which `ray stop` would.

Each command also gets its own $RAY_TMPDIR: the Ray it starts keeps its session files and its
`ray_current_cluster` address file there, so a `ray.init()` elsewhere never finds and joins it,
and it never joins one found in /tmp/ray.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the virtualenv's bin: python, prefill, ray


@dataclass
class Result:
    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    leaked: list[str] = field(default_factory=list)  # processes still alive after the grace period

    def explain(self, tail: int = 4000) -> str:
        return (f"$ {' '.join(self.cmd)}\nexit {self.returncode} after {self.seconds:.1f} s\n"
                f"--- stdout (tail)\n{self.stdout[-tail:]}\n--- stderr (tail)\n{self.stderr[-tail:]}")


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on this machine right now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def ray_tmpdir() -> str:
    """A short private directory for $RAY_TMPDIR (Ray's socket paths must stay under 107 bytes)."""
    return tempfile.mkdtemp(prefix="rt", dir="/tmp" if os.path.isdir("/tmp") else None)


def isolated_env(tmpdir: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # a test decides itself which cluster a command joins
    env.update(RAY_TMPDIR=tmpdir, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               COLUMNS="160", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    env.update(extra)
    return env


def session_members(sid: int) -> dict[int, str]:
    """pid -> command line of every live (non-zombie) process in session `sid` (Linux only)."""
    found = {}
    if not os.path.isdir("/proc"):
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[3]) != sid or fields[0] == "Z":
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue
        found[int(entry)] = cmdline[:200]
    return found


def end_session(sid: int, grace_s: float) -> list[str]:
    """Wait up to `grace_s` for session `sid` to empty, then SIGTERM and finally SIGKILL what is
    left. Returns the processes that had to be killed."""
    deadline = time.monotonic() + grace_s
    while session_members(sid) and time.monotonic() < deadline:
        time.sleep(0.25)
    left = session_members(sid)
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        members = session_members(sid)
        if not members:
            break
        for pid in members:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while session_members(sid) and time.monotonic() < deadline:
            time.sleep(0.1)
    return [f"{pid} {cmd}" for pid, cmd in left.items()]


def run(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None,
        cwd: str | Path = ROOT, grace_s: float = 20.0) -> Result:
    """Run `cmd` in a new session; raise AssertionError (with its output) if it outlives
    `timeout`. Whatever it leaves running is killed after `grace_s` and listed in `.leaked`."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        # Files, not pipes: a leftover grandchild holding a pipe open would block the read.
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=err, text=True, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            end_session(proc.pid, grace_s=0)
            returncode = proc.wait()
            timed_out = True
        seconds = time.monotonic() - start
        leaked = end_session(proc.pid, grace_s=0 if timed_out else grace_s)
        out.seek(0)
        err.seek(0)
        result = Result(list(map(str, cmd)), returncode, out.read(), err.read(), seconds, leaked)
    if timed_out:
        raise AssertionError(f"timed out after {timeout} s\n{result.explain()}")
    return result


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
