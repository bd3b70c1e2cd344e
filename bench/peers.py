"""The engine beside the engines a user would pick instead: vLLM's CPU build and llama.cpp (and
transformers), on this machine, one process per system and dtype, the same token ids, the same
threads, greedy tokens compared. Tokens/s for prefill of 512 and 2048 tokens and for decode,
timed in turns: the processes of one dtype start one after another, then take every call of
each round in turn (`interleaved` says what is timed), one call running at a time.

    bash scripts/setup_peers.sh            # once, opt-in: vLLM and llama.cpp in venvs of their own
    .venv/bin/python -m bench.peers --dtypes float32 bfloat16 --out peers.jsonl
    .venv/bin/python -m bench.peers --systems engine vllm --engine-from REV   # before/after

Weights: the engine and transformers read the shipped Q4_1 GGUF dequantized; vLLM reads an HF
directory saved from it by transformers (the same values); llama.cpp reads F32 / BF16 GGUFs
written from the same dequantized values, and the Q4_1 file as it is. A system whose venv is
missing is skipped, and said so.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import machine, print_table, random_ids
from engine.loading.checkpoint import open_checkpoint, resolve_model
from engine.plan import COMPILE_ENV

PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "prefill-engine" / "peers"))
# the venv under PEERS_DIR that llama.cpp runs from: `llamacpp` (built for this CPU), or
# `llamacpp-noamx` (scripts/setup_peers.sh: without AMX, whose path crashed on the Q4_1 file on
# our AMX Xeons)
LLAMACPP_VENV = os.environ.get("PEERS_LLAMACPP", "llamacpp")
LLAMACPP = "llama.cpp" + ("" if LLAMACPP_VENV == "llamacpp" else f" ({LLAMACPP_VENV})")
RUNNER = Path(__file__).with_name("peer_run.py")
REPO = RUNNER.parents[1]


def checkout(rev: str, work: Path) -> Path:
    """The repository at git revision `rev`, checked out (detached) under `work`, for
    --engine-from; remove it with `remove_checkout`."""
    folder = work / f"engine-at-{rev}"
    done = subprocess.run(["git", "worktree", "add", "--detach", str(folder), rev], cwd=REPO,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"--engine-from {rev}: git could not check it out: {done.stderr.strip()}")
    return folder


def remove_checkout(folder: Path) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(folder)], cwd=REPO,
                   capture_output=True)


def default_label() -> str:
    # the environment can keep an engine whose compile is unset eager: a row says so
    setting = os.environ.get(COMPILE_ENV)
    return f"engine, default ({COMPILE_ENV}={setting})" if setting else "engine, default"


# the engine's rows besides its defaults: system -> (label, settings, environment)
ENGINE_VARIANTS = {
    # the built-in kernels, untimed: what measuring gains
    "engine-fixed": ("engine, kernel_choice=fixed", {"kernel_choice": "fixed"}, None),
    "engine-int8": ("engine, weights=int8", {"weights": "int8"}, None),
    "engine-gguf": ("engine, weights=gguf (Q4_1 as stored)", {"weights": "gguf"}, None),
    # where compile is on by default (engine.plan.compiles)
    "engine-eager": ("engine, compile=False", {"compile": False}, None),
    "engine-compile": ("engine, compile=True", {"compile": True}, None),
    # every torch tensor of 2 MB or more on transparent huge pages (activations, the KV
    # cache), not only the weights the engine moves itself
    "engine-thp": ("engine, THP_MEM_ALLOC_ENABLE=1", {}, {"THP_MEM_ALLOC_ENABLE": "1"}),
    # torch's own OpenMP and malloc, where the launchers would preload Intel's and tcmalloc
    "engine-gnu": ("engine, PREFILL_ENGINE_CPU_RUNTIME=gnu", {},
                   {"PREFILL_ENGINE_CPU_RUNTIME": "gnu"}),
}


def _engine_rows(systems: list[str], dtype: str,
                 engine_from: dict[str, Path] | None) -> list[dict]:
    """The engine rows asked for, each followed by the same row at every revision of
    `engine_from`."""
    asked = [(default_label(), {}, None)] if "engine" in systems else []
    asked += [variant for name, variant in ENGINE_VARIANTS.items() if name in systems]
    rows = []
    for label, settings, env in asked:
        row = dict(label=label, system="engine", dtype=dtype, form="gguf")
        row.update({k: v for k, v in (("settings", settings), ("env", env)) if v})
        rows.append(row)
        for rev, root in (engine_from or {}).items():
            at = "engine" if not settings and not env else label
            rows.append({**row, "label": f"{at} at {rev}", "root": str(root)})
    return rows


def rows_to_run(systems: list[str], dtypes: list[str],
                engine_from: dict[str, Path] | None = None) -> list[dict]:
    """(label, system, dtype, weights form, settings) for every row of the table;
    `engine_from`: git revisions whose engine runs beside today's, each from its checkout
    (`root`), each engine row asked for with that revision's code."""
    rows = []
    for dtype in dtypes:
        rows += _engine_rows(systems, dtype, engine_from)
        if "transformers" in systems:
            rows.append(dict(label="transformers", system="transformers", dtype=dtype, form="gguf"))
        if "vllm" in systems:
            rows.append(dict(label="vLLM CPU", system="vllm", dtype=dtype, form="hf"))
        if "llamacpp" in systems:
            for fa in (True, False):
                rows.append(dict(label=f"{LLAMACPP} {dtype}, flash-attn {'on' if fa else 'off'}",
                                 system="llamacpp", dtype=dtype, form=f"gguf-{dtype}",
                                 settings={"flash_attn": fa}))
    if "llamacpp" in systems:
        rows.append(dict(label=f"{LLAMACPP}, Q4_1 as shipped", system="llamacpp", dtype="q4_1",
                         form="gguf-q4_1", settings={"flash_attn": False}))
    return rows


# The peers' context window (vLLM's max_model_len, llama.cpp's n_ctx): at least this, longer
# where a timed prompt and its new tokens need it (up to the model's own: a longer one is the
# peer's error). The engine and transformers take the model's own.
PEER_CONTEXT = 4096
CONTEXT_SETTING = {"vllm": "max_model_len", "llamacpp": "n_ctx"}


def peer_settings(row: dict, args: argparse.Namespace) -> dict:
    """The row's settings, with the context its system needs for the longest call asked."""
    longest = max(*args.lengths, args.decode_prompt + args.decode_tokens) + 1
    key = CONTEXT_SETTING.get(row["system"])
    return ({key: max(PEER_CONTEXT, longest)} if key else {}) | row.get("settings", {})


def interpreter(system: str) -> Path | None:
    if system in ("engine", "transformers"):
        return Path(sys.executable)
    python = PEERS_DIR / (LLAMACPP_VENV if system == "llamacpp" else system) / "bin" / "python"
    return python if python.exists() else None


def peer_env(system: str, threads: int, extra: dict | None = None) -> dict:
    """The environment of a system's process; `extra`: a row's own variables."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), **(extra or {})}
    if system == "vllm":
        # as vLLM's CPU guide runs it: every core for its workers (its default keeps one back
        # for the scheduler), tcmalloc and Intel's OpenMP preloaded where present
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
        env["VLLM_CPU_KVCACHE_SPACE"] = "2"
        preload = [p for p in (Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
                               *(PEERS_DIR / "vllm" / "lib").glob("libiomp5.so")) if p.exists()]
        if preload:
            env["LD_PRELOAD"] = ":".join(map(str, preload))
    return env


def weights(form: str, work: Path, model: str) -> str | None:
    """The path each system reads, made once from `model` (None: not from this checkpoint)."""
    source = resolve_model(model)
    if form == "gguf" or (form == "hf" and source.is_dir()):
        return str(source)  # the engine and transformers read either kind
    if source.suffix != ".gguf":
        return None  # llama.cpp's files are written from a GGUF
    if form == "gguf-q4_1":
        return str(source)
    target = work / form
    if not target.exists():
        if form == "hf":
            save_hf_directory(source, target)
        else:
            write_dequantized_gguf(source, target, form.removeprefix("gguf-"))
    return str(target)


def save_hf_directory(gguf_path: Path, target: Path) -> None:
    """transformers' model of the GGUF, saved as safetensors: a model loaded from a GGUF counts
    as quantized and refuses to save, so its values go into a plain model of the same config."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launcher.baseline import hf_model

    loaded = hf_model(str(gguf_path))
    plain = AutoModelForCausalLM.from_config(loaded.config)
    plain.load_state_dict(loaded.state_dict())
    if hasattr(plain.config, "quantization_config"):  # says "gguf": vLLM would refuse it
        del plain.config.quantization_config
    plain.save_pretrained(target)
    AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(target)


def write_dequantized_gguf(source: Path, target: Path, dtype: str) -> None:
    """`source` with every tensor widened to float32 or bfloat16, metadata unchanged."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    kind = gguf.GGMLQuantizationType.F32 if dtype == "float32" else gguf.GGMLQuantizationType.BF16
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if t.tensor_type == gguf.GGMLQuantizationType.F32 or kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(t.name, values)
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


class Peer:
    """One row's system in its process (bench/peer_run.py), answering one timed call at a time."""

    def __init__(self, row: dict, path: str, work: Path, threads: int, settings: dict,
                 quiet_wait_s: float):
        """`quiet_wait_s`: the longest wait for a quiet machine before each call (0: none)."""
        self.quiet_wait_s = quiet_wait_s
        dtype = "float32" if row["dtype"] == "q4_1" else row["dtype"]
        # an engine at another revision: its checkout's runner, which imports that engine
        runner = Path(row["root"]) / RUNNER.relative_to(REPO) if "root" in row else RUNNER
        cmd = [str(interpreter(row["system"])), str(runner), "--system", row["system"],
               "--dtype", dtype, "--model", path, "--threads", str(threads),
               "--settings", json.dumps(settings)]
        self.row, self.log = row, work / f"{len(list(work.glob('*.log')))}.log"
        with open(self.log, "w") as log:  # a file: a full stderr pipe would stall the peer
            env = peer_env(row["system"], threads, row.get("env"))
            self.process = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE,
                                            stderr=log, text=True, cwd=runner.parents[1])
        self.start_s = self._answer("READY ")["start_s"]

    def call(self, ids: list[int], n: int) -> tuple[float, list[int], float | None]:
        """(seconds, greedy tokens, seconds to the first token or None where the system does not
        say) of one call of n new tokens after `ids`."""
        limit = self.quiet_wait_s
        if limit > 0 and wait_until_quiet(limit) >= limit:
            print(f"busy machine: {self.row['label']} was timed with the CPUs still busy after "
                  f"{limit:.0f} s of waiting; its figures share them", flush=True)
        self.process.stdin.write(json.dumps({"ids": ids, "n": n}) + "\n")
        self.process.stdin.flush()
        answer = self._answer("RESULT ")
        return answer["seconds"], answer["tokens"], answer.get("first_token_s")

    def _answer(self, prefix: str) -> dict:
        for line in self.process.stdout:  # a system may print lines of its own
            if line.startswith(prefix):
                return json.loads(line.removeprefix(prefix))
        raise RuntimeError(f"{self.row['label']} exited ({self.process.wait()}):\n"
                           f"{self.log.read_text()[-2000:]}")

    def close(self) -> None:
        try:
            self.process.stdin.close()  # the peer's loop ends at the end of its input
        except BrokenPipeError:  # it had exited already
            pass
        self.process.wait()


# Each call starts on a quiet machine: a peer may keep a core busy after its own last call
# (vLLM's processes spun one core for ~1 s after each call on the AVX512-BF16 EPYC, session 46,
# which slowed whichever system was timed next: the engine's float32 512-token prefill read
# 802-803 tok/s alternating with vLLM, 845-879 alternating with itself or another engine).
# Quiet: less than QUIET_CPUS of one CPU busy, machine-wide, over QUIET_WINDOW_S. A machine
# never that quiet (other tenants) is timed anyway, after at most --quiet-wait seconds.
QUIET_CPUS = 0.3
QUIET_WINDOW_S = 0.2


def wait_until_quiet(max_s: float) -> float:
    """Wait until the machine is quiet (at most `max_s`; at once where Linux's /proc/stat is
    unreadable); the seconds waited, `max_s` or more where it never was."""
    start = time.monotonic()
    before = busy_cpu_seconds()
    while before is not None and time.monotonic() - start < max_s:
        time.sleep(QUIET_WINDOW_S)
        after = busy_cpu_seconds()
        if after - before < QUIET_CPUS * QUIET_WINDOW_S:
            break
        before = after
    return time.monotonic() - start


def busy_cpu_seconds() -> float | None:
    """CPU-seconds every CPU has spent busy since boot (user, nice, system, irq, softirq:
    not idle, I/O wait or time the hypervisor gave to others), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:8]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq = ticks
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def start_peers(rows: list[dict], work: Path, args: argparse.Namespace) -> list[Peer]:
    """Each row's process, started one after another so each start-up is timed alone; a row
    whose venv or weights are missing, or whose start fails, is skipped and said so."""
    peers = []
    for row in rows:
        if interpreter(row["system"]) is None:
            print(f"skipped {row['label']}: no venv at {PEERS_DIR / row['system']} "
                  f"(bash scripts/setup_peers.sh {row['system']})", flush=True)
            continue
        path = weights(row["form"], work, args.model)
        if path is None:
            print(f"skipped {row['label']}: its weights are written from a GGUF model", flush=True)
            continue
        try:
            peers.append(Peer(row, path, work, args.threads, peer_settings(row, args),
                              args.quiet_wait))
        except RuntimeError as e:
            print(f"FAILED {row['label']}: {e}", flush=True)
    return peers


# A pause before each call: an OpenMP runtime keeps the threads of the call that just ended
# spinning for a while (Intel's, which the engine and vLLM preload, for 200 ms: KMP_BLOCKTIME),
# on the cores the next system's call needs, and a short prompt would start among them
SETTLE_S = 0.3


def interleaved(peers: list[Peer], inputs: dict, repeats: int) -> list[dict]:
    """Every row's timings, taken in turns: each round times every call of the protocol on
    every peer before the next round (the order of the peers rotating), so a slow minute of a
    shared machine falls on all of them, not on whichever ran then. Prefill = one call over the
    whole prompt that returns the first token; decode = the time after the first token of a
    call of n + 1 tokens, within that call (peer_run says when each system's first token came;
    a runner of an older revision does not, and its row takes that call less a call of 1,
    whose two prompt times can differ by more than a long prompt's decode takes); each the
    best of `repeats` rounds, after one untimed call of each (its tokens are the ones
    reported). A peer that fails is dropped, and said so."""
    ids, n = inputs["decode"], inputs["decode_tokens"]
    calls = {**{f"prefill {k}": (v, 1) for k, v in inputs["prefill"].items()},
             "decode first": (ids, 1), "decode whole": (ids, n + 1)}
    tokens: dict[Peer, dict] = {p: {} for p in peers}
    best: dict[Peer, dict] = {p: dict.fromkeys([*calls, "after first"], float("inf"))
                              for p in peers}
    for r in range(-1, repeats):  # round -1: the untimed first calls
        for name, (prompt, new_tokens) in calls.items():
            for p in peers[r % len(peers):] + peers[:r % len(peers)] if peers else []:
                time.sleep(SETTLE_S)
                try:
                    seconds, out, first = p.call(prompt, new_tokens)
                except RuntimeError as e:
                    print(f"FAILED {p.row['label']}: {e}", flush=True)
                    peers.remove(p)
                    continue
                if r < 0:
                    tokens[p][name] = out
                    continue
                best[p][name] = min(best[p][name], seconds)
                if name == "decode whole" and first is not None:
                    best[p]["after first"] = min(best[p]["after first"], seconds - first)
    return [{**p.row, "start_s": p.start_s,
             "prefill_tok_s": {k: len(v) / best[p][f"prefill {k}"]
                               for k, v in inputs["prefill"].items()},
             "first_tokens": {k: tokens[p][f"prefill {k}"] for k in inputs["prefill"]},
             "decode_tokens": tokens[p]["decode whole"], **decode_rate(best[p], n)}
            for p in peers]


def decode_rate(best: dict[str, float], n: int) -> dict:
    """A row's decode tokens/s from its best timings, and how they were taken; the two calls'
    difference is kept beside the figure timed within the call, to show what it would read."""
    apart = n / max(best["decode whole"] - best["decode first"], 1e-9)
    if best["after first"] < float("inf"):
        return {"decode_tok_s": n / max(best["after first"], 1e-9), "decode_timed": "in the call",
                "decode_by_difference_tok_s": apart}
    return {"decode_tok_s": apart, "decode_timed": "two calls' difference"}


def dtype_groups(rows: list[dict]) -> list[list[dict]]:
    """The rows of each dtype, whose processes live (and are timed in turns) together; the
    4-bit llama.cpp row joins the last group, beside the engine's quantized rows."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        key = row["dtype"] if row["dtype"] != "q4_1" or not groups else list(groups)[-1]
        groups.setdefault(key, []).append(row)
    return list(groups.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--systems", nargs="+", default=["engine", "transformers", "vllm", "llamacpp"],
                    choices=["engine", "engine-fixed", "engine-int8", "engine-gguf",
                             "engine-eager", "engine-compile", "engine-thp", "engine-gnu",
                             "transformers", "vllm", "llamacpp"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="peers.jsonl")
    ap.add_argument("--model", default="smollm2", help="an alias, a .gguf or an HF directory")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048], help="prefill tokens")
    ap.add_argument("--decode-prompt", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--engine-from", nargs="+", default=[], metavar="REV",
                    help="also run each engine row asked for as it was at these git revisions "
                         "(a before/after in one run)")
    ap.add_argument("--quiet-wait", type=float, default=10.0, metavar="S",
                    help="the longest wait for a quiet machine before each timed call; past it "
                         "the call is timed anyway and said so (0: no wait, for a check of the "
                         "tokens on a busy machine, whose figures mean little)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="peers-"))
    engine_from = {rev: checkout(rev, work) for rev in args.engine_from}
    try:
        run(args, work, engine_from)
    finally:
        for folder in engine_from.values():
            remove_checkout(folder)
        # the peers' weights (up to ~0.5 GB a run for SmolLM2) and logs, whose tails a failed
        # peer's error already gave
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path, engine_from: dict[str, Path]) -> None:
    inputs, vocab = work / "inputs.json", open_checkpoint(args.model).config.vocab_size
    inputs.write_text(json.dumps({"prefill": {str(n): random_ids(n, vocab, seed=n)
                                              for n in args.lengths},
                                  "decode": random_ids(args.decode_prompt, vocab, seed=1),
                                  "decode_tokens": args.decode_tokens}))
    print(f"{machine()}; {args.threads} threads per system; best of {args.repeats} "
          f"interleaved rounds", flush=True)
    rows, results = rows_to_run(args.systems, args.dtypes, engine_from), []
    with open(args.out, "w") as out:
        for group in dtype_groups(rows):  # one dtype's processes at a time
            peers = start_peers(group, work, args)
            try:
                for result in interleaved(peers, json.loads(inputs.read_text()), args.repeats):
                    results.append(result)
                    out.write(json.dumps(result) + "\n")
            finally:
                for peer in peers:
                    peer.close()
    report(results, args.lengths)


def report(results: list[dict], lengths: list[int]) -> None:
    """The table, and whether each row's greedy tokens match the float32 engine's."""
    reference = next((r for r in results if r["label"] == default_label()
                      and r["dtype"] == "float32"), None)
    rows = []
    for r in results:
        same = ("-" if reference is None else
                "yes" if r["decode_tokens"] == reference["decode_tokens"] else
                f"{sum(a == b for a, b in zip(r['decode_tokens'], reference['decode_tokens']))}"
                f"/{len(reference['decode_tokens'])}")
        rows.append([r["label"], r["dtype"],
                     *(f"{r['prefill_tok_s'][str(n)]:.0f}" for n in lengths),
                     f"{r['decode_tok_s']:.1f}" + ("" if r["decode_timed"] == "in the call"
                                                   else " *"),
                     f"{r['start_s']:.0f}", same])
    print_table("tokens/s (prefill: one call over the prompt; decode: after the first token "
                "within the call; *: two calls' difference, from a runner that does not say when "
                "its first token came)",
                ["system", "dtype", *(f"prefill {n}" for n in lengths), "decode", "start s",
                 "tokens = engine fp32"], rows)


if __name__ == "__main__":
    main()
