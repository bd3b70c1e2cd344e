"""engine.cpu_runtime: Intel's OpenMP and tcmalloc preloaded by the launchers where they won on
this machine: the choice measured once and kept, the relaunch of a real app, and no relaunch of
a program that only imported one."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from engine import cpu_runtime, machine
from engine.errors import ConfigError
import launcher

ROOT = Path(__file__).resolve().parents[1]
X86_LINUX = platform.machine() == "x86_64" and sys.platform == "linux"


@pytest.mark.skipif(not X86_LINUX, reason="the intel-openmp wheel is x86-64 Linux's")
def test_setup_installs_intel_openmp():
    libraries = cpu_runtime.intel_libraries()
    assert libraries and Path(libraries[-1]).name == "libiomp5.so", libraries
    assert Path(libraries[-1]).is_file()


@pytest.mark.skipif(not X86_LINUX, reason="the intel-openmp wheel is x86-64 Linux's")
@pytest.mark.parametrize("runtime,says,app", [
    ("intel", "Intel's OpenMP", ["-m", "launcher.generate"]),
    ("gnu", "torch's own", ["-m", "launcher.generate"]),
    ("intel", "Intel's OpenMP", ["launcher/generate.py"])],  # by its path
    ids=["intel", "gnu", "intel-by-path"])
def test_generate_relaunches_itself_preloaded_where_asked(runtime, says, app):
    """And torch is imported once, by the process that runs the app: the one that starts itself
    again preloaded does so before any import of torch (`-X importtime` is passed on to the
    relaunched process, so both report their imports on stderr)."""
    env = {**os.environ, cpu_runtime.CHOICE_ENV: runtime, "COLUMNS": "200"}
    env.pop(cpu_runtime.RELAUNCHED_ENV, None)
    env.pop("LD_PRELOAD", None)
    done = subprocess.run([sys.executable, "-X", "importtime", *app, "max_tokens=2"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(l for l in done.stdout.splitlines() if "this process's runtime" in l)
    assert says in line, line
    torch_imports = [l for l in done.stderr.splitlines() if l.startswith("import time:")
                     and l.rsplit("|", 1)[-1].strip() == "torch"]
    assert len(torch_imports) == 1, torch_imports


def test_the_engine_package_imports_torch_only_when_its_classes_are_used():
    """What lets a launcher start itself again before importing torch (above)."""
    code = ("import sys, engine, engine.cpu_runtime\n"
            "print('torch' in sys.modules, engine.ConfigError.__name__)\n"
            "from engine import LLM\n"
            "print('torch' in sys.modules, LLM.__module__)\n"
            "try:\n    engine.NoSuchName\nexcept AttributeError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "False ConfigError", "True engine.llm",
        "module 'engine' has no attribute 'NoSuchName'"], done.stdout


def test_the_choice_is_measured_once_and_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_runtime.CHOICE_ENV, raising=False)
    monkeypatch.setattr(cpu_runtime, "intel_libraries", lambda: ["/lib/libiomp5.so"])
    measured = []
    monkeypatch.setattr(cpu_runtime, "measure", lambda: measured.append(1) or
                        {"choice": "intel", "intel_s": 1.0, "gnu_s": 2.0})
    assert cpu_runtime.choice() == "intel" and cpu_runtime.choice() == "intel"
    assert measured == [1]
    assert (tmp_path / "cpu_runtime.json").is_file()
    monkeypatch.setattr(cpu_runtime, "intel_libraries", lambda: ["/other/libiomp5.so"])
    cpu_runtime.choice()  # other libraries: measured again
    assert measured == [1, 1]


def test_an_out_of_date_choice_is_measured_again_each_way_keeping_its_better_time(
        monkeypatch, tmp_path):
    """A kept choice over REMEASURE_AFTER old is probed again; each way keeps the lower of its
    kept and new times, and the choice follows them: a first probe in which the faster way was
    slowed by something else running decides only until then."""
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_runtime.CHOICE_ENV, raising=False)
    monkeypatch.setattr(cpu_runtime, "intel_libraries", lambda: ["/lib/libiomp5.so"])
    probes = iter([{"intel_s": 3.0, "gnu_s": 2.0},  # the first probe: intel slowed
                   {"intel_s": 1.0, "gnu_s": 2.5}])
    monkeypatch.setattr(cpu_runtime, "measure", lambda: {"choice": "gnu", **next(probes)})
    assert cpu_runtime.choice() == "gnu" and cpu_runtime.choice() == "gnu"  # kept: not probed
    monkeypatch.setattr(machine, "REMEASURE_AFTER", -1.0)
    assert cpu_runtime.choice() == "intel"
    [kept] = json.loads((tmp_path / "cpu_runtime.json").read_text()).values()
    assert (kept["intel_s"], kept["gnu_s"], kept["choice"]) == (1.0, 2.0, "intel")


@pytest.mark.skipif(not X86_LINUX, reason="the intel-openmp wheel is x86-64 Linux's")
def test_measure_times_the_probe_both_ways(monkeypatch):
    monkeypatch.setattr(cpu_runtime, "PROBE_ROUNDS", 1)
    got = cpu_runtime.measure()
    assert got["intel_s"] > 0 and got["gnu_s"] > 0
    # the rule, from the two times: preloading must win by the margin
    assert got["choice"] == ("intel" if got["intel_s"] * cpu_runtime.MARGIN < got["gnu_s"]
                             else "gnu")


def test_a_bad_setting_names_the_fix(monkeypatch, capsys):
    monkeypatch.setenv(cpu_runtime.CHOICE_ENV, "fast")
    monkeypatch.delenv(cpu_runtime.RELAUNCHED_ENV, raising=False)
    with pytest.raises(ConfigError, match="PREFILL_ENGINE_CPU_RUNTIME='fast': use one of"):
        cpu_runtime.choice()
    with pytest.raises(SystemExit) as ended:  # a launcher: one line and exit code 2
        cpu_runtime.relaunch_preloaded()
    assert ended.value.code == 2
    assert capsys.readouterr().err.startswith("error: PREFILL_ENGINE_CPU_RUNTIME='fast'")


def test_a_failed_probe_keeps_torchs_runtime_and_is_not_repeated(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_runtime.CHOICE_ENV, raising=False)
    monkeypatch.setattr(cpu_runtime, "intel_libraries", lambda: ["/lib/libiomp5.so"])
    failed = []

    def failing() -> dict:
        failed.append(1)
        raise RuntimeError("the intel probe failed: Segmentation fault")
    monkeypatch.setattr(cpu_runtime, "measure", failing)
    assert cpu_runtime.choice() == "gnu" and cpu_runtime.choice() == "gnu"
    assert failed == [1]
    monkeypatch.setattr(machine, "REMEASURE_AFTER", -1.0)  # until it is out of date
    assert cpu_runtime.choice() == "gnu" and failed == [1, 1]


@pytest.mark.parametrize("printed", ["", "OMP: Info #276: omp_set_nested deprecated\n"])
def test_a_probe_that_prints_no_time_keeps_torchs_runtime(monkeypatch, tmp_path, printed):
    """A probe process that exits 0 but whose last word is not a time (nothing printed, or a
    library's own line after it) is a failed probe, kept as torch's runtime with why; the
    launcher that asked goes on."""
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_runtime.CHOICE_ENV, raising=False)
    monkeypatch.setattr(cpu_runtime, "intel_libraries", lambda: ["/lib/libiomp5.so"])
    monkeypatch.setattr(cpu_runtime.subprocess, "run", lambda cmd, **kw: (
        subprocess.CompletedProcess(cmd, 0, stdout=printed, stderr="")))
    assert cpu_runtime.choice() == "gnu"
    [kept] = json.loads((tmp_path / "cpu_runtime.json").read_text()).values()
    assert "probe printed no time" in kept["error"]


APP_FILE = str(Path(launcher.__file__).parent / "generate.py")
RAY_WORKER = "/venv/lib/python3.11/site-packages/ray/_private/workers/default_worker.py"


@pytest.mark.parametrize("orig_argv,argv0,an_app", [
    (["python", "-m", "launcher.generate", "max_tokens=2"], "-m", True),
    (["python", "-X", "importtime", "-m", "launcher.serve"], "-m", True),
    (["python", APP_FILE, "max_tokens=2"], APP_FILE, True),  # by its path
    (["python", "-m", "pytest", "-q"], "-m", False),
    (["python", "-m", "bench.peers"], "-m", False),
    (["python", "-c", "import launcher.generate"], "-c", False),
    (["python", RAY_WORKER, "--node-ip-address=1.2.3.4"], RAY_WORKER, False),
    (["python", str(ROOT / "tests" / "generate.py")], str(ROOT / "tests" / "generate.py"), False),
])
def test_only_an_apps_own_process_is_relaunched(monkeypatch, orig_argv, argv0, an_app):
    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    monkeypatch.setattr(sys, "argv", [argv0, *orig_argv[2:]])
    assert launcher.runs_an_app() is an_app


def test_a_relaunched_process_is_never_relaunched_again(monkeypatch):
    relaunched = []
    monkeypatch.setattr(os, "execve", lambda *a: relaunched.append(a))
    monkeypatch.setenv(cpu_runtime.RELAUNCHED_ENV, "/lib/libmine.so")
    monkeypatch.setenv("LD_PRELOAD", "/lib/libmine.so:/lib/libiomp5.so")
    cpu_runtime.relaunch_preloaded()  # once relaunched, never again
    assert relaunched == []
    # and what it starts gets the environment it was started with
    assert os.environ["LD_PRELOAD"] == "/lib/libmine.so"
    assert cpu_runtime.RELAUNCHED_ENV not in os.environ
