"""bench.peers, the side-by-side with the engines a user would pick instead, run on the rows
that need no peer venv (the engine and transformers) at tiny lengths, each in a process of its
own: the engine's greedy tokens, as the bench reports them, equal transformers' (an independent
reference), and a peer without its venv is skipped with the command that makes it."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench import peers
from bench.peers import wait_until_quiet
from tests.cpu_features import needs_huge_pages
from tests.subproc import ROOT


def test_engine_and_transformers_rows_agree_and_a_missing_peer_is_named(tmp_path, tiny_model_dir):
    out = tmp_path / "peers.jsonl"
    cmd = [sys.executable, "-m", "bench.peers", "--model", str(tiny_model_dir("llama")),
           "--systems", "engine", "transformers", "vllm", "llamacpp",
           "--dtypes", "float32", "--repeats", "1", "--lengths", "16", "--decode-prompt", "12",
           "--decode-tokens", "4", "--out", str(out), "--quiet-wait", "0"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PEERS_DIR=str(tmp_path / "no_peers")))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # the suite keeps engines whose compile is unset eager (conftest), and the row says so
    assert [r["label"] for r in rows] == ["engine, default (PREFILL_ENGINE_COMPILE=0)",
                                          "transformers"]
    engine, hf = rows
    assert engine["first_tokens"] == hf["first_tokens"]
    assert len(engine["decode_tokens"]) == 5 and engine["decode_tokens"] == hf["decode_tokens"]
    assert all(r["prefill_tok_s"]["16"] > 0 and r["decode_tok_s"] > 0 for r in rows)
    # both say when their first token came: decode is timed within the call
    assert [r["decode_timed"] for r in rows] == ["in the call"] * 2
    assert "skipped vLLM CPU: no venv" in done.stdout
    assert "bash scripts/setup_peers.sh vllm" in done.stdout
    assert done.stdout.count("skipped llama.cpp") == 3  # f32 with and without flash-attn, Q4_1
    assert "busy machine" not in done.stdout  # --quiet-wait 0: timed at once, nothing to say


def test_decode_is_the_time_after_the_first_token_within_a_call_where_a_system_says_it():
    """64 tokens after the first, 0.5 s of them within the call: 128 tok/s; a system that does
    not say when its first token came: the call of 65 tokens less the call of 1."""
    within = {"after first": 0.5, "decode whole": 9.0, "decode first": 1.0}
    assert peers.decode_rate(within, 64) == {"decode_tok_s": 128.0, "decode_timed": "in the call",
                                             "decode_by_difference_tok_s": 8.0}
    apart = {"after first": float("inf"), "decode whole": 2.5, "decode first": 2.0}
    assert peers.decode_rate(apart, 64) == {"decode_tok_s": 128.0,
                                            "decode_timed": "two calls' difference"}


def test_the_engine_at_another_revision_runs_from_its_own_checkout(tmp_path, tiny_model_dir,
                                                                    monkeypatch):
    """--engine-from REV: a row of the engine as checked out at REV, run by that checkout's
    runner (so its own engine package), beside today's, greedy tokens equal; the checkout and
    the run's folder are gone afterwards. HEAD stands in for an older revision (a clean clone has no other)."""
    out = tmp_path / "peers.jsonl"
    made = []
    checkout = peers.checkout
    monkeypatch.setattr(peers, "checkout",
                        lambda rev, work: made.append(checkout(rev, work)) or made[-1])
    monkeypatch.setattr(sys, "argv", [
        "bench.peers", "--model", str(tiny_model_dir("llama")), "--systems", "engine",
        "--engine-from", "HEAD", "--dtypes", "float32", "--repeats", "1", "--lengths", "16",
        "--decode-prompt", "12", "--decode-tokens", "4", "--out", str(out), "--quiet-wait", "0"])
    runners = []
    popen = subprocess.Popen

    def recorded(cmd, **kw):  # the runner scripts of the peers started
        if str(cmd[1]).endswith("peer_run.py"):
            runners.append(cmd[1])
        return popen(cmd, **kw)

    monkeypatch.setattr(peers.subprocess, "Popen", recorded)
    peers.main()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["label"] for r in rows][1:] == ["engine at HEAD"]
    assert rows[0]["decode_tokens"] == rows[1]["decode_tokens"]
    assert rows[0]["first_tokens"] == rows[1]["first_tokens"]
    [folder] = made
    assert runners == [str(peers.RUNNER), str(folder / "bench" / "peer_run.py")]
    assert not folder.parent.exists()  # the run's folder (the checkout in it) removed with it


@needs_huge_pages
def test_the_thp_row_puts_the_engines_large_tensors_on_huge_pages():
    """--systems engine-thp: the row's process gets THP_MEM_ALLOC_ENABLE=1, under which torch
    advises its tensors of 2 MB or more onto transparent huge pages (a 64 MB one lands there);
    the default row's process does not set it."""
    [plain, row] = peers.rows_to_run(["engine", "engine-thp"], ["float32"])
    assert "THP_MEM_ALLOC_ENABLE" not in peers.peer_env("engine", 2, plain.get("env"))
    probe = ("import torch\nfrom tests.cpu_features import huge_page_kb\n"
             "x = torch.ones(16 * 2**20)\nprint(huge_page_kb())")
    huge_kb = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             check=True, cwd=ROOT,
                             env=peers.peer_env("engine", 2, row["env"])).stdout
    assert int(huge_kb) >= 32 * 1024, huge_kb


def _spinner(seconds: float) -> subprocess.Popen:
    """A process keeping one core busy for `seconds`."""
    return subprocess.Popen([sys.executable, "-c", "import time\nt = time.monotonic()\n"
                             f"while time.monotonic() - t < {seconds}:\n    pass"])


def test_a_call_waits_while_another_process_keeps_a_core_busy():
    """bench.peers starts each timed call on a quiet machine: a process spinning on one core
    (as a vLLM peer's did for ~1 s after each of its calls) holds the next call back until it
    stops."""
    spinner = _spinner(1.5)
    try:
        time.sleep(0.4)  # started, spinning
        wait_until_quiet(10.0)
        assert spinner.poll() is not None, "released while the spinner still ran"
    finally:
        spinner.kill()
        spinner.wait()


def test_a_machine_that_stays_busy_is_timed_anyway_and_said_so():
    """Past its limit of waiting the call is timed anyway, and the wait says it never saw the
    machine quiet (Peer.call then prints that the row's figures share the CPUs)."""
    spinner = _spinner(5.0)
    try:
        time.sleep(0.4)
        waited = wait_until_quiet(0.6)
        assert spinner.poll() is None, "the spinner ended: the machine did get quiet"
        assert 0.6 <= waited < 3.0
    finally:
        spinner.kill()
        spinner.wait()


def test_llama_cpp_runs_from_the_venv_peers_llamacpp_names(tmp_path):
    """PEERS_LLAMACPP=llamacpp-noamx (scripts/setup_peers.sh's build without AMX): llama.cpp's
    rows run that venv's interpreter and their labels say so; unset, the `llamacpp` venv's."""
    code = ("from bench import peers; print(peers.interpreter('llamacpp')); "
            "print('|'.join(r['label'] for r in peers.rows_to_run(['llamacpp'], ['bfloat16'])))")
    for venv in ("llamacpp-noamx", None):
        python = tmp_path / (venv or "llamacpp") / "bin" / "python"
        python.parent.mkdir(parents=True, exist_ok=True)
        python.touch()
        env = {k: v for k, v in os.environ.items() if k != "PEERS_LLAMACPP"}
        env.update(PEERS_DIR=str(tmp_path), **({"PEERS_LLAMACPP": venv} if venv else {}))
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, cwd=ROOT, timeout=120)
        assert done.returncode == 0, done.stderr
        where, labels = done.stdout.split("\n")[:2]
        assert where == str(python)
        named = "llama.cpp (llamacpp-noamx)" if venv else "llama.cpp"
        assert labels.split("|") == [f"{named} bfloat16, flash-attn on",
                                     f"{named} bfloat16, flash-attn off",
                                     f"{named}, Q4_1 as shipped"]


def test_the_peers_context_fits_the_longest_call():
    """vLLM's and llama.cpp's context window stays 4096 tokens unless a timed call needs more
    (a prompt, or the decode call's prompt and tokens, and the one token after): then exactly
    that; a row's own settings are kept beside it; the engine and transformers get none (they
    take the model's own context)."""
    rows = {row["system"]: row for row in peers.rows_to_run(
        ["engine", "transformers", "vllm", "llamacpp"], ["float32"])}
    long = argparse.Namespace(lengths=[512, 8000], decode_prompt=256, decode_tokens=64)
    short = argparse.Namespace(lengths=[512, 2048], decode_prompt=256, decode_tokens=64)
    decode = argparse.Namespace(lengths=[16], decode_prompt=4500, decode_tokens=64)
    assert peers.peer_settings(rows["vllm"], long) == {"max_model_len": 8001}
    assert peers.peer_settings(rows["vllm"], short) == {"max_model_len": 4096}
    assert peers.peer_settings(rows["vllm"], decode) == {"max_model_len": 4565}
    assert peers.peer_settings(rows["llamacpp"], long) == {
        "n_ctx": 8001, "flash_attn": rows["llamacpp"]["settings"]["flash_attn"]}
    assert peers.peer_settings(rows["engine"], long) == {}
    assert peers.peer_settings(rows["transformers"], long) == {}
