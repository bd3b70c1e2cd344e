"""Shared fixtures: one Ray cluster per test worker, tiny checkpoints built once."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the CPU kernel timings (engine.rank.kernel_choice) of this run, apart from the user's own
os.environ.setdefault("PREFILL_ENGINE_CACHE", tempfile.mkdtemp(prefix="prefill-engine-test-"))
# A CPU engine whose compile is unset compiles its layers (engine.plan.compiles): a minute or so
# at each new model's first start. Tests run eagerly unless they set compile=True, or use the
# smollm2_llm engine below, which keeps the user's default; PREFILL_ENGINE_COMPILE= (empty)
# runs the whole suite with the default.
os.environ.setdefault("PREFILL_ENGINE_COMPILE", "0")
# Triton decides interpreter vs compiled when a kernel is decorated, i.e. at import: set it before
# any test module imports triton. A machine with a GPU runs the kernels compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Files whose tests hold several engines or a whole app at a time (GiBs each). Two workers run
# the suite (pyproject's addopts): one takes all of these, in turn, so two of them never run
# side by side; with one of them beside a lighter file the machine peaked at 20.4 of 24 GiB.
MEMORY_HEAVY_FILES = {"tests/test_serve_ray.py", "tests/test_docs_commands.py",
                      "tests/test_disagg.py", "tests/test_readme_job.py"}


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent where pytest runs without it
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadFileScheduling

    if config.getoption("dist") != "loadfile":
        return None
    root = Path(__file__).resolve().parents[1]
    gone = sorted(f for f in MEMORY_HEAVY_FILES if not (root / f).is_file())
    if gone:  # a renamed file would leave the lane without a word
        raise pytest.UsageError(f"tests/conftest.py MEMORY_HEAVY_FILES names no file: {gone}")

    class HeavyFilesInOneLane(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return "memory-heavy files" if file in MEMORY_HEAVY_FILES else file

    return HeavyFilesInOneLane(config, log)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance shared by every test that needs rank actors."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """build(name) -> directory of a tiny random checkpoint, saved once per session."""
    from engine.loading.synthetic import build

    root = tmp_path_factory.mktemp("tiny_models")
    return lambda name: build(name, root)


@pytest.fixture(scope="session")
def smollm2_path():
    from engine.loading.checkpoint import resolve_model

    return str(resolve_model("smollm2"))


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    from tests.reference import hf_model

    return hf_model(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_llm():
    """One single-rank engine on SmolLM2 with the user's defaults (compiled where the engine
    decides so: PREFILL_ENGINE_COMPILE does not apply to it), shared by the tests that only
    read from it."""
    from engine import LLM
    from engine.plan import COMPILE_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(COMPILE_ENV, raising=False)
        llm = LLM("smollm2")
    with llm:
        yield llm
