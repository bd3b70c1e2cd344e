"""Every command in README.md and docs/*.md, run as written, from the repository root.

A ```bash block is run here line by line (`.venv/bin/` stands for this interpreter's virtualenv)
unless the HTML comment on the line above it names the test that covers it instead:

    <!-- run by tests/FILE.py::TEST -->          that test reads the block from the page and runs it
    <!-- checked, not run: WHY ... tests/FILE.py::TEST ... -->   it cannot end by itself (a server)

Parts of a line that `.ci/run` runs as written (the setup, the whole suite) are left to it. Every
`python -m launcher.<app> key=value ...` line, run here or not, is also composed by Hydra without
starting anything, and every `python -m <module>` the pages name must exist, so an unknown key or
a renamed module fails here in a second, whichever test runs the command.

The apps write their files where a person's run would (`walkthrough/`, `bench_results.jsonl`,
`bench_plots/`, `scores.jsonl`, all git-ignored); what was there before is set aside and put back.
"""
from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import subproc
from tests.subproc import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CI_RUN = ROOT / ".ci" / "run"
APP_OUTPUTS = ["walkthrough", "bench_results.jsonl", "bench_plots", "scores.jsonl"]
COMMAND_TIMEOUT_S = 600  # a loaded 2-core machine: 6 of these timed out at 300 s at load average 25-36
PARALLEL_COMMANDS = 2  # the commands run two at a time: model loading leaves a core idle

BLOCK = re.compile(r"(?:<!--(?P<marker>.*?)-->\n)?```bash\n(?P<body>.*?)```", re.S)
TEST_NAME = re.compile(r"(tests/\w+\.py)::(\w+)")
MODULE = re.compile(r"python -m ([\w.]+)")

# What the run of a command must print, beyond exit code 0 and nothing left running.
EXPECTED_OUTPUT = {
    ".venv/bin/python -m launcher.generate": [  # the default prompt, through the chat template
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>", "Paris", "TTFT", "tp=1"],
    "chat=false max_tokens=8 engine.dtype=bfloat16": ["' Paris'", "TTFT", "torch.bfloat16"],
    "prefill generate parallel.tp=2 max_tokens=8": ["tp=2", "Paris", "Started a local Ray instance"],
}  # keyed by how the command ends


@dataclass(frozen=True, slots=True)
class Block:
    page: Path
    marker: str  # the HTML comment above the block, or ""
    lines: tuple[str, ...]  # its command lines, continuations joined, comment-only lines dropped

    @property
    def where(self) -> str:
        return str(self.page.relative_to(ROOT))


def strip_comment(line: str) -> str:
    """The line without a trailing `# comment` (a # outside quotes, after a space)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def doc_blocks(pages: list[Path] = PAGES) -> list[Block]:
    blocks = []
    for page in pages:
        for m in BLOCK.finditer(page.read_text()):
            joined = m["body"].replace("\\\n", " ")
            lines = tuple(s for s in (strip_comment(x).strip() for x in joined.splitlines()) if s)
            blocks.append(Block(page, (m["marker"] or "").strip(), lines))
    return blocks


def ci_commands() -> set[str]:
    return {strip_comment(x).strip() for x in CI_RUN.read_text().splitlines()}


def commands_to_run(blocks: list[Block]) -> list[str]:
    """The unmarked blocks' commands, each once, without what `.ci/run` runs as written."""
    ci, seen = ci_commands(), []
    for block in blocks:
        if block.marker:
            continue
        for line in block.lines:
            for part in (p.strip() for p in line.split(" && ")):
                if part not in ci and part not in seen:
                    seen.append(part)
    return seen


def as_run_here(command: str) -> str:
    return command.replace(".venv/bin/", f"{subproc.BIN}/")


BLOCKS = doc_blocks()
TO_RUN = commands_to_run(BLOCKS)
MARKED = [b for b in BLOCKS if b.marker]


# ---- the commands, run as written --------------------------------------------------------------

@pytest.fixture(scope="module")
def parked_outputs(tmp_path_factory):
    """The apps' output files in the repo root, set aside while the commands run, then put back."""
    parking = tmp_path_factory.mktemp("parked")
    for name in APP_OUTPUTS:
        if (ROOT / name).exists():
            shutil.move(ROOT / name, parking / name)
    untracked = _untracked()
    try:
        yield untracked
    finally:
        for name in APP_OUTPUTS:
            target = ROOT / name
            shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
            if (parking / name).exists():
                shutil.move(parking / name, target)


def _untracked() -> set[str]:
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return {line[3:] for line in out.splitlines() if line.startswith("??")}


def _run(command: str) -> subproc.Result:
    """The command's result; one that outlives its timeout fails alone, not the others."""
    tmp = subproc.ray_tmpdir()
    try:
        return subproc.run(["bash", "-c", as_run_here(command)], timeout=COMMAND_TIMEOUT_S,
                           env=subproc.isolated_env(tmp))
    except AssertionError as timed_out:  # subproc.run's report, with the output so far
        return subproc.Result([command], -1, "", str(timed_out), COMMAND_TIMEOUT_S)
    finally:
        subproc.remove(tmp)


@pytest.fixture(scope="module")
def results(parked_outputs):
    with ThreadPoolExecutor(PARALLEL_COMMANDS) as pool:
        return dict(zip(TO_RUN, pool.map(_run, TO_RUN)))


@pytest.mark.parametrize("command", TO_RUN)
def test_command_runs_as_written(results, command):
    r = results[command]
    assert r.returncode == 0, r.explain()
    assert not r.leaked, f"left running: {r.leaked}\n{r.explain()}"
    for text in next((v for k, v in EXPECTED_OUTPUT.items() if command.endswith(k)), []):
        assert text in r.stdout + r.stderr, f"{text!r} missing\n{r.explain()}"


def test_commands_leave_no_new_files_outside_the_ignored_outputs(results, parked_outputs):
    assert _untracked() == parked_outputs


def test_every_expected_output_belongs_to_a_command():
    for key in EXPECTED_OUTPUT:
        assert any(c.endswith(key) for c in TO_RUN), key


# ---- blocks other tests run --------------------------------------------------------------------

@pytest.mark.parametrize("block", MARKED, ids=lambda b: f"{b.where}:{b.lines[0][:40]}")
def test_a_marked_block_names_a_test_that_reads_it(block):
    assert block.marker.startswith(("run by ", "checked, not run: ")), block.marker
    named = TEST_NAME.findall(block.marker)
    assert named, f"{block.where}: the marker names no tests/FILE.py::TEST: {block.marker}"
    for file, test in named:
        source = (ROOT / file).read_text()
        functions = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}
        assert test in functions, f"{block.where} names {file}::{test}, which does not exist"
        if block.marker.startswith("run by "):  # it reads this page, so it runs this very block
            assert block.page.name in source, f"{file} never reads {block.where}"


# ---- every app line composes; every module exists ----------------------------------------------

def app_commands(blocks: list[Block]) -> list[tuple[str, list[str]]]:
    """(app, overrides) of every `python -m launcher.<app> ...` line and `prefill <app> ...`."""
    found: list[tuple[str, list[str]]] = []
    for block in blocks:
        for line in block.lines:
            for part in line.split(" && "):
                words = shlex.split(part)
                if "-m" in words and words[words.index("-m") + 1].startswith("launcher."):
                    i = words.index("-m") + 1
                    app = (words[i].removeprefix("launcher."), words[i + 1:])
                elif words and words[0].endswith("bin/prefill"):
                    app = (words[1], words[2:])
                else:
                    continue
                if app not in found:
                    found.append(app)
    return found


def compose(app: str, args: list[str]):
    """The app's config with these command-line words, composed by Hydra as the app would."""
    from hydra import compose as hydra_compose, initialize_config_dir

    from launcher.build_engine import CONF_DIR

    multirun = "-m" in args or "--multirun" in args
    overrides = [a for a in args if a not in ("-m", "--multirun") and "=" in a]
    if multirun:  # one point of the sweep: compose refuses sweeps
        overrides = [re.sub(r"^([\w.]+)=([^,]+),.*$", r"\1=\2", o) for o in overrides]
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return hydra_compose(config_name=app, overrides=overrides)


@pytest.mark.parametrize("app, args", app_commands(BLOCKS),
                         ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_app_command_composes(app, args):
    assert importlib.util.find_spec(f"launcher.{app}") is not None, f"no module launcher.{app}"
    compose(app, args)


def test_every_module_the_pages_name_exists():
    missing = [(p.name, m) for p in PAGES for m in MODULE.findall(p.read_text())
               if importlib.util.find_spec(m.rstrip(".")) is None]
    assert not missing, missing


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        file, _, fragment = target.partition("#")
        linked = (page.parent / file).resolve() if file else page
        headings = re.findall(r"^#+ (.*)$", linked.read_text(), re.M) if linked.is_file() else []
        if not linked.exists() or (fragment and fragment not in map(anchor, headings)):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_lead_to_a_file_and_heading(page):
    assert not broken_links(page)


def test_a_wrong_command_is_caught():
    """The checks above can fail: a misspelt key, a renamed module, a marker naming no test."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="not_a_key"):
        compose("generate", ["engine.not_a_key=1"])
    assert importlib.util.find_spec("launcher.not_an_app") is None
    page = ROOT / "README.md"
    wrong = Block(page, "run by tests/test_serve.py::test_no_such_test", ("true",))
    with pytest.raises(AssertionError, match="does not exist"):
        test_a_marked_block_names_a_test_that_reads_it(wrong)


def test_a_wrong_link_is_caught(tmp_path):
    (tmp_path / "page.md").write_text("# A heading\n[ok](#a-heading) [no](#b) [gone](other.md)\n")
    assert broken_links(tmp_path / "page.md") == ["#b", "other.md"]
