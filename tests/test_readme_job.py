"""docs/scaling.md's "On a Ray cluster, and as a Ray job" commands, run as a new user would type them.

The block is read from docs/scaling.md and run by bash in a fresh environment (no RAY_AUTH_MODE, no
RAY_ADDRESS, a private $RAY_TMPDIR). Three things differ from a person's terminal, and only
these: the ports are free ones instead of 6379/8265, and the head's dashboard agent gets a free
port too (this machine is shared with other Ray clusters), `.venv` is this interpreter's
virtualenv, and the final `ray stop` (which stops every Ray on the machine) is left
to the test harness, which ends everything the block started.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from tests import subproc

PAGE = Path(__file__).resolve().parents[1] / "docs" / "scaling.md"
HEADING = "## On a Ray cluster, and as a Ray job"


def doc_job_block() -> str:
    text = PAGE.read_text()
    section = text[text.index(HEADING):]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def test_doc_job_commands_work_as_written():
    """Both ways onto a `ray start` cluster: an app joining it through $RAY_ADDRESS (it must not
    start a Ray of its own) and a submitted job (it must succeed, its app's table in its log)."""
    block = doc_job_block()
    assert "ray job submit" in block and "ray start --head" in block
    gcs, dash, agent = subproc.free_ports(3)
    venv = Path(sys.executable).parent.parent
    script = (block.replace("6379", str(gcs)).replace("8265", str(dash))
              .replace("source .venv/bin/activate", f"source {venv}/bin/activate")
              .replace("ray start --head", f"ray start --head --dashboard-agent-listen-port={agent}"))
    script = "\n".join(line for line in script.splitlines() if line.strip() != "ray stop")
    tmp = subproc.ray_tmpdir()
    try:
        env = subproc.isolated_env(tmp)
        env.pop("RAY_AUTH_MODE", None)
        r = subproc.run(["bash", "-ec", script], timeout=600, env=env, grace_s=30)
    finally:
        subproc.remove(tmp)
    assert r.returncode == 0, r.explain()
    assert "AuthenticationError" not in r.stdout + r.stderr, r.explain()
    said = r.stdout + r.stderr
    assert "succeeded" in said.lower(), r.explain()
    assert "Connecting to existing Ray cluster" in said, r.explain()
    assert "Started a local Ray instance" not in said, r.explain()
    assert said.count("TTFT") >= 2 and "Paris" in said, r.explain()  # both apps' tables
