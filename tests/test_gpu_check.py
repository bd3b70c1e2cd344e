"""scripts/gpu_check.sh, the one prepared call for a lent GPU: its time limits fit one device
call, it runs bench.gpu_check's sections in the documented order, and a section run here (dry
run: tiny sizes, Triton interpreted) writes its figures into the shared JSON as it goes."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from bench import gpu_check

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = (ROOT / "scripts" / "gpu_check.sh").read_text()
DEVICE_CALL_LIMIT_S = 500  # what one call may take (600 s), less a margin; start-up not counted


def _limits() -> list[tuple[str, int]]:
    sections = re.findall(r"^\s*section (\w+) (\d+)", SCRIPT, re.M)
    steps = re.findall(r'^\s*step "([^"]+)" \$\(\((\d+) \* SCALE\)\)', SCRIPT, re.M)
    return [(n, int(s)) for n, s in sections + steps]


def test_time_limits_fit_one_device_call():
    limits = _limits()
    assert len(limits) == len(gpu_check.SECTIONS) + 1  # + the kernel tests
    assert sum(s for _, s in limits) < DEVICE_CALL_LIMIT_S, limits


def test_sections_run_in_the_documented_order():
    ran = re.findall(r"^\s*section (\w+) \d+", SCRIPT, re.M)
    assert ran == list(gpu_check.SECTIONS)
    documented = re.findall(r"^  (\w+)\s{2,}", gpu_check.__doc__, re.M)
    assert documented == ran


def test_sections_save_each_figure_into_one_json(tmp_path):
    """Two sections in a row, as the script runs them: each adds its own figures beside the
    other's. The tokens section also checks the torch and Triton backends agree."""
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    for section in ("peak", "tokens"):
        proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", section, "--json",
                               str(out), "--dry-run", "--models", str(tmp_path / "models")],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["peak"]["matmul"]["tflops"] > 0
    assert report["tokens"]["same_tokens"] == {"identical": True, "first_difference_at": None}
    assert report["tokens"]["triton_as_close_as_torch"] is True
    for backend in ("torch", "triton"):  # float32 here: both as close as rounding allows
        assert report["tokens"][f"{backend}_tokens"]["logprob_max_err"] < 1e-3
    assert len(report["tokens"]["torch_tokens"]["tokens"]) == 16


def test_the_tp2_section_computes_half_of_each_layer():
    """A layer of one TP=2 rank's shape holds half the full layer's projection weights (norms
    aside), counted by transformers' own Llama layer. The first GPU check's half shape derived
    its head dim from the hidden size: 256, so Q and O stayed full width."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    def projection_params(shape: dict) -> int:
        with torch.device("meta"):
            layer = LlamaDecoderLayer(LlamaConfig(**shape), layer_idx=0)
        return sum(p.numel() for n, p in layer.named_parameters() if "norm" not in n)

    full = gpu_check.LLAMA3_8B
    half = gpu_check.one_rank_shape(full, 2)
    assert 2 * projection_params(half) == projection_params(full)
    assert half["head_dim"] == full["hidden_size"] // full["num_attention_heads"]
