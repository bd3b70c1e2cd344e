"""weights="int8" | "int4" | "gguf": quantized projections against plain-torch references.

References are written here, independently of engine/rank/quantized.py: the quantization
formulas (int8 per channel; int4 as GGUF's Q4_1, groups of 32), and `gguf.quants` for the
codes read raw. Stated tolerances: a product against its dequantized float32 matmul 1e-4
(float32 rounding); a tiny model quantized by the engine against the same model with the
reference's quantize-dequantized weights run in float32, 1e-4 (only rounding differs); SmolLM2
with its Q4_1 blocks as stored against its dequantized float32 self, max |Δ logit| under 5 % of
the largest logit (the int8 LM head re-quantizes the Q8_0 embedding per channel: that and
rounding are all that differ; 2.3 % measured) and the same greedy tokens.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.errors import ConfigError
from engine.loading import gguf_blocks
from engine.loading.checkpoint import open_checkpoint
from engine.loading.synthetic import random_token_ids
from engine.rank import gemm, quantized
from tests.cpu_features import HUGE_PAGES_ON
from tests.row_timings import certain_row_timings

PROMPT = random_token_ids(24, 250, seed=5)


def ref_int8(w: torch.Tensor) -> torch.Tensor:
    """Symmetric per output row: s = max|w| / 127, q = round(w / s)."""
    s = w.abs().max(dim=1, keepdim=True).values / 127
    return torch.round(w / s).clamp(-127, 127) * s


def ref_int4(w: torch.Tensor) -> torch.Tensor:
    """Q4_1 per 32 inputs: d = (max - min) / 15, q = round((w - min) / d) in 0..15."""
    g = w.reshape(w.shape[0], -1, 32)
    low, high = g.min(-1, keepdim=True).values, g.max(-1, keepdim=True).values
    d = (high - low) / 15
    return (torch.round((g - low) / d).clamp(0, 15) * d + low).reshape(w.shape)


REFERENCE = {"int8": (quantized.int8_per_channel, ref_int8),
             "int4": (quantized.int4_groups, ref_int4)}


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_linear_matches_dequantize_then_matmul(kind):
    quantize, reference = REFERENCE[kind]
    torch.manual_seed(0)
    w, bias = torch.randn(96, 128), torch.randn(96)
    for rows in (1, quantized.KERNEL_ROWS + 1):  # the kernel's path, then the dequantized one
        x = torch.randn(rows, 128)
        want = x @ reference(w).T + bias
        torch.testing.assert_close(gemm.linear(x, quantize(w), bias), want, atol=1e-4, rtol=1e-4)
        # bf16 activations, scales and output: 8-bit mantissas, within 1 % of the outputs' range
        got = gemm.linear(x.bfloat16(), quantize(w.bfloat16()), None).float()
        want = x.bfloat16().float() @ reference(w.bfloat16().float()).T
        assert (got - want).abs().max() < 0.01 * want.abs().max()
    # the quantizer is a real one: within half a step of the float weight
    step = (w.abs().amax(1, keepdim=True) / 127 if kind == "int8"
            else (w.reshape(96, 4, 32).amax(-1) - w.reshape(96, 4, 32).amin(-1))
            .repeat_interleave(32, 1) / 15)
    assert ((reference(w) - w).abs() <= step / 2 + 1e-6).all()


def test_int8_rows_slice_as_the_float_rows():
    w, x = torch.randn(50, 64), torch.randn(3, 64)
    torch.testing.assert_close(gemm.linear(x, quantized.int8_per_channel(w)[10:30]),
                               x @ ref_int8(w)[10:30].T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_raw_q4_codes_reproduce_gguf_dequantize(kind):
    qtype = gguf.GGMLQuantizationType[kind]
    w = np.random.default_rng(1).standard_normal((32, 96)).astype(np.float32)
    data = gguf.quants.quantize(w, qtype)
    want = torch.from_numpy(gguf.quants.dequantize(data, qtype))
    blocks = gguf_blocks.unpack(data, kind)
    values = (blocks.codes.float() * blocks.scales.repeat_interleave(32, 1)
              + blocks.mins.repeat_interleave(32, 1))
    assert torch.equal(values, want)
    weight = quantized.from_q4_blocks(blocks, torch.float32)
    for rows in (1, quantized.KERNEL_ROWS + 1):  # the kernel's path, then the dequantized one
        x = torch.randn(rows, 96)
        torch.testing.assert_close(gemm.linear(x, weight), x @ want.T, atol=1e-4, rtol=1e-4)


def test_smollm2_blocks_read_raw_equal_its_dequantized_slices(smollm2_path):
    """Row slices of the un-permuted q rows, whole k, and a rank's column half of down_proj."""
    ckpt = open_checkpoint(smollm2_path)
    down = ckpt.file.tensors["blk.3.ffn_down.weight"]  # the file's own blocks
    cases = [("model.layers.0.self_attn.q_proj.weight", 0, 64, 256, None),
             ("model.layers.0.self_attn.k_proj.weight", None, 0, 0, None),
             ("model.layers.3.mlp.down_proj.weight", 1, 768, 1536,
              gguf.quants.dequantize(down.data, down.tensor_type)[:, 768:1536])]  # gguf's decoding
    for name, dim, a, b, direct in cases:
        blocks = ckpt.read_q4(name, dim, a, b)
        values = (blocks.codes.float() * blocks.scales.repeat_interleave(32, 1)
                  + blocks.mins.repeat_interleave(32, 1))
        assert torch.equal(values, ckpt.read(name, dim, a, b)), name
        if direct is not None:
            assert torch.equal(values, torch.from_numpy(np.ascontiguousarray(direct)))
    with pytest.raises(ConfigError, match="32-value blocks"):
        ckpt.read_q4("model.layers.3.mlp.down_proj.weight", 1, 0, 100)


def _fake_quantized(src, dst, kind):
    """A copy of the HF directory `src` whose projections hold the reference's dequantized
    values (the LM head int8, as the engine keeps it in every mode)."""
    import shutil

    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        for name, t in tensors.items():
            if name.endswith("_proj.weight"):
                tensors[name] = REFERENCE[kind][1](t)
            elif name == "lm_head.weight":
                tensors[name] = ref_int8(t)
        save_file(tensors, file, metadata={"format": "pt"})
    return dst


@pytest.fixture(params=["torch", "engine"])
def row_kernels(request, monkeypatch, tmp_path):
    """Which kernels a quantized engine's few-row products run, made certain rather than timed:
    "torch": torch's weight-only kernels (kernel_choice="fixed"); "engine": the engine's C++
    ones (engine.rank.quantized_rows), made to win every timing."""
    if request.param == "torch":
        return {"kernel_choice": "fixed"}
    certain_row_timings(monkeypatch, tmp_path / "timings")
    return {}


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_tiny_model_matches_its_dequantized_float_twin(tiny_model_dir, tmp_path, kind,
                                                       row_kernels):
    """Either kernel (int4's C++ one rounds x to int16 per group: within 1e-4 here too)."""
    path = tiny_model_dir("llama")
    twin = _fake_quantized(path, tmp_path / kind, kind)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(str(twin), enable_prefix_caching=False) as ref:
        want, want_tokens = ref.prefill([PROMPT])[0].logits, ref.generate([PROMPT], greedy)
        want_score = ref.score([PROMPT])[0].logprobs
    with LLM(str(path), weights=kind, enable_prefix_caching=False, **row_kernels) as llm:
        got = llm.prefill([PROMPT])[0].logits
        assert llm.generate([PROMPT], greedy)[0].token_ids == want_tokens[0].token_ids
        got_score = llm.score([PROMPT])[0].logprobs  # the LM head tiled by rows
        quantized_bytes = llm.rank_info()[0].weight_bytes
        engine_rows = sum(line.split(" ", 1)[0].endswith("-rows") and ": fused (" in line
                          for line in llm.rank_info()[0].kernels)
        assert engine_rows == (5 if row_kernels == {} else 0)  # 4 projection shapes, LM head
        with llm.tracing() as ops:
            llm.generate([PROMPT[:3]], SamplingParams(max_tokens=2, ignore_eos=True))
    # the tracer's bytes for a decode step's q/k/v product: x, codes, scales, out (a hand count
    # for [1, 64] x [64, 128]: int8 1 byte a weight + a float32 scale per row; int4 half a byte
    # + a float32 scale and zero per 32)
    codes = {"int8": 128 * 64 + 128 * 4, "int4": 128 * 32 + 2 * 128 * 2 * 4}[kind]
    qkv = [op for op in ops if op["name"].endswith("qkv_proj") and op["shapes"].startswith("[1,")]
    assert qkv and qkv[0]["bytes"] == 64 * 4 + codes + 128 * 4
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(got_score), torch.tensor(want_score),
                               atol=1e-4, rtol=1e-4)
    with LLM(str(path)) as fp32:
        assert quantized_bytes < 0.6 * fp32.rank_info()[0].weight_bytes


def test_tp2_int4_equals_tp1(ray_cluster, tiny_model_dir, tmp_path):
    """Each rank quantizes its slice; groups of 32 along the input never straddle the ranks'
    column split here (mistral: 4 heads x 8 and an FFN half of 64 per rank), so tp=1 and
    tp=2 both equal the float twin holding the dequantized values, to float32 rounding. Each
    is checked against the twin: one full-suite run (session 44) saw tp=2 and tp=1 apart by
    3.3 at every logit and never again (6 reruns, a 760-test rerun), so a failure must say which
    side was off and what its ranks ran."""
    path = tiny_model_dir("mistral")
    with LLM(str(_fake_quantized(path, tmp_path / "twin", "int4"))) as twin:
        want = twin.prefill([PROMPT])[0].logits
    for tp in (1, 2):
        # torch's kernels (kernel_choice="fixed"): this is about each rank's slice; the
        # engine's int4 kernel rounds x to int16, past 1e-4 here (the twin test covers it)
        with LLM(str(path), weights="int4", tp=tp, kernel_choice="fixed") as llm:
            got = llm.prefill([PROMPT])[0].logits
            kernels = [info.kernels for info in llm.rank_info()]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"tp={tp} against the float twin: {m}\n"
                                                 f"its ranks' kernels: {kernels}")


def test_smollm2_gguf_blocks_as_stored(smollm2_path, smollm2_llm):
    ids = smollm2_llm.tokenize("The capital of France is")
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    want = smollm2_llm.prefill([ids])[0].logits
    want_tokens = smollm2_llm.generate([ids], greedy)[0].token_ids
    with LLM(smollm2_path, weights="gguf") as llm:
        got = llm.prefill([ids])[0].logits
        assert llm.generate([ids], greedy)[0].token_ids == want_tokens
        # 301 of 538 MB: the float32 embedding (113 MB) stays, codes cost 1 byte a weight + scales
        info = llm.rank_info()[0]
        assert info.weight_bytes < 0.6 * smollm2_llm.rank_info()[0].weight_bytes
        if HUGE_PAGES_ON:  # on huge pages: what decode streams, counted by hand
            weights = 30 * 576 * (960 + 576 + 2 * 1536 + 1536)  # the projections'
            streamed = (49152 * 576 * 4  # the float32 embedding
                        + 49152 * 576  # the int8 LM head
                        + weights // 2  # 4-bit codes, two a byte
                        + weights // 32 * 2 * 4)  # a float32 scale and zero per 32
            assert info.huge_page_bytes >= 0.9 * streamed, info
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert not torch.equal(got, want)  # the quantized path did run


@pytest.mark.parametrize("settings,named", [
    (dict(weights="int3"), "weights='int3'"),
    (dict(weights=4), "weights=4"),
    (dict(weights="int8", dtype="float16"), "use dtype='float32' or 'bfloat16'"),
    (dict(weights="int4", decode_dtype="bfloat16"), "unset decode_dtype"),
    (dict(weights="gguf"), "needs a .gguf checkpoint"),
])
def test_bad_settings_are_refused(tiny_model_dir, settings, named):
    with pytest.raises(ConfigError, match=named):
        LLM(str(tiny_model_dir("llama")), **settings)


def test_int4_shapes_the_kernel_cannot_take_are_refused(tiny_model_dir):
    """The uneven model's hidden size 72 is no multiple of 32: int4 says so, int8 runs; at
    tp=2 the llama model's FFN half (48) is refused by the driver, before any rank starts."""
    path = str(tiny_model_dir("uneven"))
    with pytest.raises(ConfigError, match="use weights='int8'"):
        LLM(path, weights="int4")
    with pytest.raises(ConfigError, match=r"rank 0's down_proj is \[64, 48\]"):
        LLM(str(tiny_model_dir("llama")), weights="int4", tp=2)
    with LLM(path, weights="int8") as llm:
        assert llm.prefill([PROMPT])[0].logits.isfinite().all()
