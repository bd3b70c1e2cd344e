"""decode_dtype='bfloat16': single-token steps read bf16 copies of the projection weights,
every other step the model's float32 ones."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ConfigError
from engine.loading.synthetic import random_token_ids
from tests.cpu_features import needs_onednn_bf16
from tests.engine_cache import fresh_cache

PROMPT = random_token_ids(32, 300, seed=11)  # two whole blocks of 16: both cached after a prefill
NEXT = 7


def _one_token_step_logits(llm: LLM) -> torch.Tensor:
    """Logits of PROMPT + [NEXT] computed as a one-row step over the cached PROMPT."""
    llm.prefill([PROMPT])
    [out] = llm.prefill([PROMPT + [NEXT]])
    assert out.cached_tokens == len(PROMPT)
    return out.logits


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """float32 throughout: the logits after PROMPT + [NEXT], computed whole."""
    path = str(tiny_model_dir("llama"))
    with LLM(path, enable_prefix_caching=False) as llm:
        return path, llm.prefill([PROMPT + [NEXT]])[0].logits


@needs_onednn_bf16
@pytest.mark.parametrize("tp,compiled", [(1, False), (2, False), (1, True)])
def test_single_token_steps_read_bf16_copies(request, reference, tp, compiled, monkeypatch,
                                             tmp_path):
    """Eager, and in the compiled decode graph (whose 1-row products stream the bf16 copies
    as a float32 multiply-and-sum; made to win the start-up timing against eager steps)."""
    from engine.rank import kernel_choice

    if tp > 1:
        request.getfixturevalue("ray_cluster")
    monkeypatch.setattr(kernel_choice, "_time_step",
                        lambda kind, candidates, rounds: {"graph": 1.0, "eager": 2.0})
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(fresh_cache(tmp_path)))  # no step timing kept
    path, want = reference
    # steps of at most 16 tokens: no packed prompt copies to count in the weight bytes below
    budget = {"max_num_batched_tokens": 16}
    with LLM(path, tp=tp, decode_dtype="bfloat16", compile=compiled, **budget) as llm:
        got = _one_token_step_logits(llm)
        if compiled:
            assert llm.step_timings()[-1].graph == "decode-1"
        # a multi-token step reads the float32 weights: as float32 as the reference
        whole = llm.prefill([PROMPT + [NEXT, NEXT]])[0]
        assert whole.cached_tokens == len(PROMPT)
        if compiled:  # a 2-token step: eager, with the float32 weights
            assert llm.step_timings()[-1].graph == ""
        with LLM(path, tp=tp, **budget) as fp32:
            want_whole = fp32.prefill([PROMPT + [NEXT, NEXT]])[0].logits
            weight_bytes = sum(i.weight_bytes for i in fp32.rank_info())
        assert sum(i.weight_bytes for i in llm.rank_info()) > 1.3 * weight_bytes
    torch.testing.assert_close(whole.logits, want_whole, atol=1e-4, rtol=1e-4)
    # bf16 products: close to float32 (8 bits of mantissa), and not identical to it
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 0.05 * scale
    assert not torch.equal(got, want)


@needs_onednn_bf16
def test_greedy_decode_runs_and_returns_to_fp32(tiny_model_dir):
    """Decode steps and prompt steps alternate in one generate; the weights swap back after
    every decode step (memory reports and prompts see float32)."""
    path = str(tiny_model_dir("llama"))
    with LLM(path, decode_dtype="bfloat16", enable_prefix_caching=False) as llm:
        before = llm.rank_info()[0].weight_bytes
        outs = llm.generate([PROMPT, PROMPT[:5]], SamplingParams(max_tokens=8, ignore_eos=True))
        assert [len(o.token_ids) for o in outs] == [8, 8]
        assert llm.rank_info()[0].weight_bytes == before
        with LLM(path, enable_prefix_caching=False) as fp32:
            want = fp32.prefill([PROMPT])[0].logits
        torch.testing.assert_close(llm.prefill([PROMPT])[0].logits, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("settings,named", [
    (dict(decode_dtype="float16"), "decode_dtype='float16'"),
    (dict(decode_dtype=True), "decode_dtype=True"),
    (dict(decode_dtype="bfloat16", dtype="bfloat16"), "dtype='bfloat16'"),
])
def test_bad_settings_are_refused(tiny_model_dir, settings, named):
    with pytest.raises(ConfigError, match=named):
        LLM(str(tiny_model_dir("llama")), **settings)
