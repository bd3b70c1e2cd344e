"""A bad key given to a Hydra app ends it with one line naming the key, the value and the fix,
and exit code 2; the traceback only with HYDRA_FULL_ERROR=1."""
from __future__ import annotations

import importlib
import os
import sys

import pytest

from tests import subproc

CLI = [sys.executable, "-c", "from launcher.cli import main; main()"]


@pytest.mark.parametrize("app, override, line", [
    ("walkthrough", "decode_tokens=0", "error: decode_tokens=0: use an integer >= 1"),  # once: max_tokens=0
    ("walkthrough", "top_k=-2", "error: top_k=-2: use an integer >= 1"),
    ("disagg", "requests=0", "error: requests=0: use an integer >= 1"),  # once: max_workers
    ("disagg", "prompt_len=0", "error: prompt_len=0: use an integer >= 1"),  # once: empty prompt
    ("disagg", "arrival_rate=-1", "error: arrival_rate=-1: use a finite number >= 0"),  # once: all at once
    ("disagg", "decode.tp=0", "error: decode.tp=0: use an integer >= 1"),
    ("bench", "prompt_len=0", "error: prompt_len=0: use an integer >= 1"),  # once: empty prompt
    ("score", "batch_size=-1", "error: batch_size=-1: use an integer >= 1"),  # once: exit 0
    ("generate", "prompt=", "error: prompt='': give non-empty text"),  # once: "empty prompt"
    ("generate", "chat=maybe", "error: chat='maybe': use true or false"),
    ("generate", "max_tokens=0", "error: max_tokens=0: use a positive integer"),
    ("generate", "parallel.tp=0", "error: tp=0: use a positive integer"),
    ("generate", "model.path=/no/such/model", "error: "),
])
def test_a_bad_key_is_one_line_and_exit_code_2(app, override, line, tmp_path, monkeypatch,
                                                capsys):
    """In process (no interpreter start per case): the app's `main()` as its console script
    runs it. Every case here is refused before a model loads, or when it does not."""
    args = [app, override] + ([f"input={tmp_path}/x.txt"] if app == "score" else [])
    (tmp_path / "x.txt").write_text("a document\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", args)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"launcher.{app}").main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert err.startswith(line) and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_the_console_script_exits_2_and_shows_a_traceback_only_when_asked():
    cmd = [*CLI, "walkthrough", "decode_tokens=0"]
    quiet = subproc.run(cmd, timeout=120)
    assert quiet.returncode == 2, quiet.explain()
    assert quiet.stderr.strip().splitlines()[-1] == "error: decode_tokens=0: use an integer >= 1"
    assert "Traceback" not in quiet.stderr, quiet.explain()
    full = subproc.run(cmd, timeout=120, env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    assert full.returncode != 0 and "Traceback" in full.stderr, full.explain()
    unknown = subproc.run([*CLI, "generate", "engine.no_such_key=1"],
                          timeout=120)
    assert unknown.returncode == 2, unknown.explain()  # Hydra's own report, made one line
    assert unknown.stderr.startswith("error: Could not override 'engine.no_such_key'")
    assert unknown.stderr.count("\n") == 1, unknown.explain()
