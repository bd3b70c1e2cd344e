"""Bad requests and bad checkpoints: a clear error naming the problem, and the engine still
serves the next valid request correctly."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, ConfigError, InvalidRequestError, ModelLoadError, UnsupportedModelError


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    path = tiny_model_dir("qwen2")
    with LLM(str(path), max_model_len=64) as llm:
        good = [7, 8, 9, 10, 11]
        yield llm, good, llm.prefill([good])[0].logits


@pytest.mark.parametrize("prompt, match", [
    ([[]], "empty prompt"),
    ([], "no prompts given"),
    ([[1, 2, -1]], "outside the vocabulary"),
    ([[1, 2, 311]], r"outside the vocabulary \[0, 311\)"),
    ([list(range(3, 68))], "65 tokens exceeds max_model_len=64"),
    ([3.5], "must be a string or a list of int"),
    ([[1.0, 2.0]], "must be a string or a list of int"),
    (42, "prompts must be a string"),
    (["text"], "ships no tokenizer"),
])
def test_bad_prompt_then_engine_still_serves(tiny, prompt, match):
    llm, good, logits = tiny
    with pytest.raises(InvalidRequestError, match=match):
        llm.prefill(prompt)
    [again] = llm.prefill([good])
    torch.testing.assert_close(again.logits, logits)
    assert llm.cache_stats()["blocks_used"] == 0  # nothing left allocated by the failed call


def test_empty_text_prompt_on_smollm2(smollm2_llm):
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        smollm2_llm.generate([""])
    [out] = smollm2_llm.prefill(["The capital of France is"])
    assert out.first_token_text == " Paris"


def test_unknown_model(tmp_path):
    with pytest.raises(ModelLoadError, match="neither a known alias"):
        LLM("no-such-model")
    with pytest.raises(ModelLoadError, match="has no config.json"):
        LLM(str(tmp_path))
    junk = tmp_path / "weights.bin"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="unrecognised model file"):
        LLM(str(junk))
    fake_gguf = tmp_path / "fake.gguf"
    fake_gguf.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        LLM(str(fake_gguf))


def _copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst, dst / "model.safetensors"


def test_missing_tensor(tiny_model_dir, tmp_path):
    path, weights = _copy_model(tiny_model_dir("qwen2"), tmp_path / "m")
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, weights)
    with pytest.raises(ModelLoadError, match="no tensor 'model.layers.1.mlp.down_proj.weight'"):
        LLM(str(path))


def test_mis_shaped_tensor(tiny_model_dir, tmp_path):
    path, weights = _copy_model(tiny_model_dir("qwen2"), tmp_path / "m")
    tensors = load_file(weights)
    tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 60)
    save_file(tensors, weights)
    with pytest.raises(ModelLoadError, match=r"o_proj.weight.*shape \(64, 60\)"):
        LLM(str(path))


def test_truncated_checkpoint(tiny_model_dir, tmp_path):
    path, weights = _copy_model(tiny_model_dir("qwen2"), tmp_path / "m")
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(str(path))


def test_unsupported_architecture(tiny_model_dir, tmp_path):
    path, _ = _copy_model(tiny_model_dir("qwen2"), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2' is not supported"):
        LLM(str(path))


@pytest.mark.parametrize("settings, match", [
    ({"max_model_len": 4096}, "exceeds the model's context of 256"),
    ({"dtype": "float64"}, "dtype='float64'"),
    ({"block_size": 0}, "block_size=0"),
    ({"not_a_setting": 1}, "unknown engine setting"),
    ({"device": "tpu"}, "device='tpu'"),
    ({"routing": "prefix-affinity"}, "routing='prefix-affinity': use one of 'prefix_affinity', "
                                     "'least_loaded'"),
    ({"routing": None}, "routing=None"),
])
def test_bad_engine_settings(tiny_model_dir, settings, match):
    with pytest.raises(ConfigError, match=match):
        LLM(str(tiny_model_dir("qwen2")), **settings)


@pytest.mark.parametrize("flag", ["no", 1, 0.0, None, np.bool_(True)])
def test_export_kv_must_be_a_bool(tiny, flag):
    """A truthy "no" pinned the prompt's blocks as if True had been given."""
    llm, good, logits = tiny
    with pytest.raises(InvalidRequestError, match=rf"export_kv={flag!r} is a .*: use True or F"):
        llm.prefill([good], export_kv=flag)
    stats = llm.cache_stats()
    assert stats["blocks_used"] == 0 and stats["kv_handles_pinned"] == 0


def test_the_smallest_cache_start_up_accepts_serves_a_max_model_len_prompt(tiny, tiny_model_dir):
    """16 blocks of 4 tokens: exactly max_model_len=64, so start-up accepts it; a 64-token
    prompt was then refused as needing 17 blocks, for generate and score alike."""
    from engine import SamplingParams
    from tests.reference import hf_greedy, hf_model

    path = str(tiny_model_dir("qwen2"))
    per_token = tiny[0].rank_info()[0].kv_bytes_per_token
    prompt = [(7 * i) % 300 + 3 for i in range(64)]
    with LLM(path, max_model_len=64, block_size=4, kv_cache_gb=16 * 4 * per_token / 2**30) as llm:
        assert llm.cache_stats()["blocks_total"] == 16
        [gen] = llm.generate([prompt], SamplingParams(max_tokens=4))
        [scored] = llm.score([prompt])
    hf = hf_model(path)
    assert gen.token_ids == hf_greedy(hf, prompt, 1) and gen.finish_reason == "length"
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt])).logits[0, :-1].float()
    want = logits.log_softmax(-1).gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert (torch.tensor(scored.logprobs) - want).abs().max().item() <= 1e-4
