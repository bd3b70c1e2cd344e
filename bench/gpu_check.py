"""The GPU check's measurements, one section per call, each figure saved the moment it exists.

    python -m bench.gpu_check SECTION --json FILE [--dry-run]

`scripts/gpu_check.sh` runs the sections in order, each under its own time limit, all into one
JSON file that is rewritten after every measurement (a section cut short keeps what it had).
Needs torch, Triton and transformers only: no Ray, Hydra, gguf or network (the device image's
python). `--dry-run` runs every section at tiny sizes on this machine (the CPU, Triton
interpreted): it proves the script, not the figures.

Sections, in the order the check runs them:
  versions         python, torch, Triton, the GPU (fails where no GPU is visible, unless dry run)
  tokens           bf16 prompt logprobs, torch and Triton backends, TP=1, against float32 HF
  flash            flash prefill TF/s, head dim 128, causal, 1k/8k: default tile, tuned tile, SDPA
  peak             the bf16 matmul peak, every MFU's denominator
  engine_eager     an engine of Llama-3-8B's layer shape (4 layers, random): start-up, prefill
                   1k/8k with MFU, compile off
  engine_compiled  the same with compile=True: start-up (compile + autotune), prefill, MFU
  decode           the decode kernel's K/V read rate
  tp2              one rank's compute at TP=2's shapes (half the heads and FFN), prefill 1k/8k
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:  # before the kernels import triton (bench.kernel_bench does)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.engine_gpu_bench import LLAMA3_8B_LAYERS as LLAMA3_8B  # noqa: E402
from bench.engine_gpu_bench import TINY, save_model  # noqa: E402


class Report:
    """One JSON file shared by every section's process; `put` rewrites it at once."""

    def __init__(self, path: str, section: str):
        self.path, self.section = Path(path), section
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {}

    def put(self, key: str, value) -> None:
        self.data.setdefault(self.section, {})[key] = value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)
        print(f"[{self.section}] {key}: {json.dumps(value, default=str)[:400]}", flush=True)

    def get(self, section: str, key: str):
        return self.data.get(section, {}).get(key)


def _device() -> torch.device:
    return torch.device("cuda", 0) if ON_CUDA else torch.device("cpu")


def _model_dir(shape: dict, layers: int, root: Path) -> str:
    """A random bf16 Llama of `shape` saved once under root (sections share it)."""
    name = "llama_" + "_".join(f"{k}{v}" for k, v in sorted(shape.items())) + f"_l{layers}"
    path = root / name
    if not (path / "config.json").exists():
        save_model(path, shape, layers, 8192, _device())
    return str(path)


def _engine(path: str, backend: str, compile_: bool, max_tokens: int, **settings):
    """(LLM, seconds to start it: load, warm-up, compile, autotune)."""
    from engine import LLM

    start = time.perf_counter()
    llm = LLM(path, device=str(_device()), dtype="bfloat16" if ON_CUDA else "float32",
              attention_backend=backend, compile=compile_, max_num_batched_tokens=max_tokens,
              max_model_len=max_tokens, kv_cache_gb=None if ON_CUDA else 0.25,
              step_timeout_s=600.0, **settings)
    return llm, time.perf_counter() - start


def versions(report: Report, args) -> None:
    import sys

    import triton

    report.put("python", sys.version.split()[0])
    report.put("torch", f"{torch.__version__} (CUDA {torch.version.cuda})")
    report.put("triton", triton.__version__)
    report.put("triton_interpret", os.environ.get("TRITON_INTERPRET"))
    if ON_CUDA:
        p = torch.cuda.get_device_properties(0)
        report.put("gpu", {"name": p.name, "sms": p.multi_processor_count,
                           "memory_gib": round(p.total_memory / 2**30),
                           "capability": f"{p.major}.{p.minor}"})
    elif not args.dry_run:
        raise SystemExit("no CUDA device visible to this python: nothing to check")


def tokens(report: Report, args) -> None:
    """Each backend's log-probabilities of a prompt against float32 transformers on the same
    weights (the check), and its 16 greedy tokens. Random weights give near-flat logits, so two
    correct bf16 backends can pick different tokens: the tokens are shown, not judged."""
    from engine import SamplingParams

    path = _model_dir(TINY if args.dry_run else dict(LLAMA3_8B, vocab_size=4096), 2,
                      args.models)
    ids = torch.randint(3, 512, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = _reference_logprobs(path, ids)
    report.put("reference_spread", round(float(reference.max() - reference.min()), 4))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    out, errors = {}, {}
    for backend in ("torch", "triton"):
        llm, startup = _engine(path, backend, False, 1024)
        with llm:
            [g] = llm.generate([ids], params)
            [scored] = llm.score([ids])
        # its shutdown gave the cache back to the driver: the next engine sizes its own from it
        out[backend] = g.token_ids
        errors[backend] = float((torch.tensor(scored.logprobs) - reference).abs().max())
        report.put(f"{backend}_tokens", {"tokens": g.token_ids, "startup_s": round(startup, 2),
                                         "logprob_max_err": float(f"{errors[backend]:.3g}")})
    same = next((i for i, (a, b) in enumerate(zip(out["torch"], out["triton"])) if a != b), None)
    report.put("same_tokens", {"identical": same is None, "first_difference_at": same})
    # Triton passes when it is as close to float32 as torch's own kernels are, give or take.
    report.put("triton_as_close_as_torch", errors["triton"] <= 2 * errors["torch"] + 1e-3)


def _reference_logprobs(path: str, ids: list[int]) -> torch.Tensor:
    """log p(ids[i+1] | ids[:i+1]) from transformers in float32, on the check's device."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(_device())
    logits = model(torch.tensor([ids], device=_device())).logits[0, :-1].float()
    del model
    if ON_CUDA:
        torch.cuda.empty_cache()
    picked = logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:], device=logits.device)[:, None])
    return picked[:, 0].cpu()


def flash(report: Report, args) -> None:
    from bench.kernel_bench import prefill_row

    kb = _kernel_args(args)
    for length in kb.lengths:
        for tuned in (False, True):
            row = prefill_row(length, length, 128, _dtype(), _device(), kb, autotune=tuned)
            report.put(f"prefill_{length}_{'tuned' if tuned else 'default'}_tile", row)


def peak(report: Report, args) -> None:
    from bench.kernel_bench import matmul_peak

    report.put("matmul", matmul_peak(_device(), _dtype(), 256 if args.dry_run else 8192,
                                     _kernel_args(args)))


def _prefill_rows(report: Report, llm, lengths: list[int], prefix: str) -> None:
    """Median prefill of each length (fresh prompts: never a prefix-cache hit), with MFU."""
    from bench.engine_gpu_bench import prefill_rows

    peak_tf = (report.get("peak", "matmul") or {}).get("tflops")
    ns = argparse.Namespace(engine_lengths=lengths, engine_repeats=1 if len(lengths) < 2 else 3)
    for row in prefill_rows(llm, ns, _device(), peak_tf):
        report.put(f"{prefix}prefill_{row['tokens']}", row)


def _engine_section(report: Report, args, compile_: bool, shape: dict) -> None:
    path = _model_dir(TINY if args.dry_run else shape, 2 if args.dry_run else 4, args.models)
    # the dry run's engines take the torch backend: interpreted Triton would only be slow.
    # kernel_choice="fixed": a compiled engine's prompts run through its graphs, untimed
    # against eager (the default runs them eagerly where that timed faster): the graphs'
    # own figures, to find why they ran slower than eager on the first H200 check
    llm, startup = _engine(path, "triton" if ON_CUDA else "torch", compile_, max(args.lengths),
                           kernel_choice="fixed")
    report.put("startup_s", round(startup, 2))
    with llm:
        info = llm.rank_info()[0]
        report.put("rank", {"compiled": info.compiled, "warmup_s": round(info.warmup_s, 2),
                            "weight_bytes": info.weight_bytes})
        _prefill_rows(report, llm, args.lengths, "")
        report.put("profile", _profile(llm, args))


def _profile(llm, args) -> dict:
    """The longest prefill once more under the profiler: time by kernel class and the
    costliest kernels (compile=True ran slower than eager on the first H200 check)."""
    from bench.engine_gpu_bench import profile_split

    return profile_split(llm, argparse.Namespace(engine_lengths=args.lengths), _device())


def engine_eager(report: Report, args) -> None:
    _engine_section(report, args, False, LLAMA3_8B)


def engine_compiled(report: Report, args) -> None:
    _engine_section(report, args, True, LLAMA3_8B)


def one_rank_shape(shape: dict, tp: int) -> dict:
    """The shape of what one rank of TP=tp computes: its share of the query and KV heads (of
    the same head dim) and of the FFN. The hidden size stays: the head dim must be pinned, or
    a config derives it as hidden / heads (doubling it, and leaving Q and O at full width)."""
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    return dict(shape, num_attention_heads=shape["num_attention_heads"] // tp,
                num_key_value_heads=shape["num_key_value_heads"] // tp,
                intermediate_size=shape["intermediate_size"] // tp, head_dim=head_dim)


def tp2(report: Report, args) -> None:
    """Rank 0 of TP=2 computes on half the query/KV heads and half the FFN: a TP=1 engine of
    that shape does the same work, without the all-reduces."""
    _engine_section(report, args, False, one_rank_shape(LLAMA3_8B, 2))


def decode(report: Report, args) -> None:
    from bench.kernel_bench import decode_row

    kb = _kernel_args(args)
    for length in kb.lengths:
        report.put(f"decode_{length}", decode_row(length, 128, _dtype(), _device(), kb))


def _dtype() -> torch.dtype:
    return torch.bfloat16 if ON_CUDA else torch.float32


def _kernel_args(args) -> argparse.Namespace:
    return argparse.Namespace(lengths=args.lengths, warmup=0 if args.dry_run else 3,
                              iters=1 if args.dry_run else 20,
                              decode_seqs=2 if args.dry_run else 16)


SECTIONS = {f.__name__: f for f in (versions, tokens, flash, peak, engine_eager, engine_compiled, decode,
                                    tp2)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("section", choices=list(SECTIONS))
    ap.add_argument("--json", required=True)
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on this machine")
    ap.add_argument("--models", type=Path, default=Path("/tmp/gpu_check_models"))
    args = ap.parse_args(argv)
    args.lengths = [48] if args.dry_run else [1024, 8192]
    torch.set_grad_enabled(False)
    report = Report(args.json, args.section)
    report.put("device", torch.cuda.get_device_name(0) if ON_CUDA else "cpu (dry run)")
    start = time.perf_counter()
    SECTIONS[args.section](report, args)
    report.put("section_s", round(time.perf_counter() - start, 1))


if __name__ == "__main__":
    main()
