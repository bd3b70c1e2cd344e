"""How a person starts the engine: the Hydra app's refusals, the `prefill` console script from
outside the repository, and `ray_head`, a `ray start` cluster for the tests that need one. The apps'
commands as the docs write them run in tests/test_docs_commands.py; joining a `ray start` cluster
through $RAY_ADDRESS and `ray job submit` run, as docs/scaling.md writes them, in
tests/test_readme_job.py.

Everything runs in subprocesses, each in its own session with its own $RAY_TMPDIR (see
tests/subproc.py), so the pytest session's own Ray (the `ray_cluster` fixture) is never joined nor
stopped. A `ray start` head here is stopped by SIGTERM to its `ray start --block` process, then
whatever is left of its session is killed: never `ray stop`, which stops every Ray on the machine.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests import subproc
from tests.subproc import BIN, ROOT

PROMPT = "The capital of France is"
APP_TIMEOUT_S = 240      # one app run: model load, (a local Ray), prefill, a few decode steps
HEAD_START_TIMEOUT_S = 90


def _app(args: list[str], timeout: float = APP_TIMEOUT_S, **env: str) -> subproc.Result:
    tmp = subproc.ray_tmpdir()
    try:
        return subproc.run([sys.executable, "-m", "launcher.generate", *args], timeout=timeout,
                           env=subproc.isolated_env(tmp, **env))
    finally:
        subproc.remove(tmp)


def _assert_paris(r: subproc.Result) -> None:
    assert r.returncode == 0, r.explain()
    assert "TTFT" in r.stdout, r.explain()
    assert "' Paris'" in r.stdout, r.explain()  # the first-token row: 7042 ' Paris'
    assert not r.leaked, f"left running: {r.leaked}\n{r.explain()}"


# ---- the Hydra app -----------------------------------------------------------------------------

def test_generate_app_rejects_an_unknown_key():
    r = _app(["engine.not_a_key=1"], timeout=120)
    assert r.returncode != 0, r.explain()
    assert "not_a_key" in r.stdout + r.stderr, r.explain()
    assert "TTFT" not in r.stdout  # failed before any engine started
    assert not r.leaked


# ---- the console script ------------------------------------------------------------------------

def _prefill_script() -> Path:
    script = BIN / "prefill"
    assert script.exists(), f"{script} is missing: scripts/setup.sh installs it (pip install -e .)"
    return script


def test_prefill_console_script_runs_generate(tmp_path):
    # From a directory outside the repository: the installed script must find its configs itself.
    tmp = subproc.ray_tmpdir()
    try:
        r = subproc.run([str(_prefill_script()), "generate", f"prompt={PROMPT}", "chat=false",
                         "max_tokens=2"], cwd=tmp_path,
                        timeout=APP_TIMEOUT_S, env=subproc.isolated_env(tmp))
    finally:
        subproc.remove(tmp)
    _assert_paris(r)


def test_prefill_console_script_without_an_app_prints_usage():
    r = subproc.run([str(_prefill_script())], timeout=60)
    assert r.returncode == 2, r.explain()
    assert "usage: prefill" in r.stderr and "generate" in r.stderr, r.explain()


# ---- a cluster started with `ray start` ----------------------------------------------------------

class Head:
    def __init__(self, gcs_port: int, dashboard_port: int, env: dict[str, str]) -> None:
        self.gcs_address = f"127.0.0.1:{gcs_port}"
        self.dashboard_url = f"http://127.0.0.1:{dashboard_port}"
        self.env = env  # what a client of this head needs: RAY_AUTH_MODE=token, its own RAY_TMPDIR


def _ensure_auth_token(env: dict[str, str]) -> None:
    """`ray start` keeps token auth on only if a token exists (~/.ray/auth_token); make one if not."""
    subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=env, timeout=60,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)


@contextmanager
def ray_head(dashboard: bool):
    """`ray start --head --block` on free ports, in its own session and $RAY_TMPDIR, token auth on.

    Stopped by SIGTERM to the `ray start` process (which stops its node's processes), then the
    rest of its session is killed; the test fails if anything had to be killed.
    """
    import ray._private.utils as ray_utils

    tmp = subproc.ray_tmpdir()
    env = subproc.isolated_env(tmp, RAY_AUTH_MODE="token")
    gcs, dash, agent, client = subproc.free_ports(4)
    cmd = [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs}", "--num-cpus=2",
           f"--include-dashboard={'true' if dashboard else 'false'}",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
           f"--dashboard-agent-listen-port={agent}", f"--temp-dir={tmp}/ray",
           "--disable-usage-stats"]
    if ray_utils.get_ray_client_dependency_error() is None:  # else there is no client server
        cmd.append(f"--ray-client-server-port={client}")
    log = Path(tmp, "head.log")
    leaked: list[str] = []
    proc = None
    try:
        _ensure_auth_token(env)
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        while "Ray runtime started" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"`{' '.join(cmd)}` did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.25)
        yield Head(gcs, dash, env)
    finally:
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            leaked = subproc.end_session(proc.pid, grace_s=10)
            proc.wait()
        subproc.remove(tmp)
    assert not leaked, f"the head left processes running: {leaked}"
