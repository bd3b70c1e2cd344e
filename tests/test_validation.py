"""Input validation on the driver: sampling values, settings, prompts and model configs are
refused with an error naming the value and the fix, and the engine serves the next request.

Expected values come from hand counts, plain torch, /proc/meminfo or a TP=1 engine."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from engine import LLM, ConfigError, InvalidRequestError, ModelLoadError, SamplingParams
from engine.batch import SamplingSpec
from engine.config import EngineConfig
from engine.driver.prompts import PromptLimits, prompt_token_ids
from engine.driver.sampling_params import check_params
from engine.rank.sampler import sample

NAN, INF = float("nan"), float("inf")
BIG_SEED = 1_796_656_113_937_735_680  # a time.time_ns(): far past what `seed * 1_000_003` left room for

# ---------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": True}, r"max_tokens=True.*bool"), ({"max_tokens": 2.0}, r"max_tokens=2\.0"),
    ({"top_k": True}, r"top_k=True.*bool"), ({"top_k": 1.5}, r"top_k=1\.5"),
    ({"seed": 1.5}, r"seed=1\.5.*integer"), ({"seed": True}, r"seed=True.*bool"),
    ({"seed": -1}, r"seed=-1.*None"), ({"seed": "7"}, r"seed='7'"),
    ({"temperature": NAN}, r"temperature=nan.*finite"),
    ({"temperature": INF}, r"temperature=inf.*finite"),
    ({"temperature": 1e-39}, r"temperature=1e-39.*at least 0\.0001"),
    ({"temperature": 5e-5}, r"temperature=5e-05.*0 for greedy"),
    ({"temperature": "0.7"}, r"temperature='0.7'.*number"),
    ({"temperature": True}, r"temperature=True.*bool"), ({"top_p": NAN}, r"top_p=nan"),
    ({"top_p": None}, r"top_p=None"), ({"ignore_eos": "yes"}, r"ignore_eos='yes'.*True or False"),
    ({"max_tokens": np.float64(2.0)}, r"max_tokens=np\.float64\(2\.0\) is a float64; use a"),
    ({"max_tokens": np.int64(0)}, r"max_tokens=np\.int64\(0\): use a positive integer"),
    ({"temperature": np.float32("nan")}, r"temperature=np\.float32\(nan\).*finite"),
    ({"ignore_eos": np.bool_(True)}, r"ignore_eos=np\.True_.*True or False"),
])
def test_bad_sampling_values_are_refused(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_numpy_numbers_are_taken_as_pythons():
    """What an eval harness computes with numpy: taken at its value, handed on as Python's."""
    given = SamplingParams(max_tokens=np.int64(3), temperature=np.float32(0.5), top_k=np.int32(5),
                           top_p=np.float64(0.9), seed=np.uint64(2**63 + 5))
    plain = SamplingParams(max_tokens=3, temperature=0.5, top_k=5, top_p=0.9, seed=2**63 + 5)
    assert given == plain
    fields = ("max_tokens", "temperature", "top_k", "top_p", "seed")
    assert [type(getattr(given, f)) for f in fields] == [int, float, int, float, int]
    assert given.spec(2) == plain.spec(2)


@pytest.mark.parametrize("seed", [2**63 - 1, 2**63, BIG_SEED, 2**64 + 5, 10**40])
def test_any_seed_samples_deterministically(seed):
    logits = torch.zeros(3, 1000)  # uniform: the generator alone picks the token
    spec = SamplingSpec(temperature=1.0, seed=seed, step=4)
    alone = sample(logits[:1], [spec])[0]
    other = SamplingSpec(temperature=1.0, seed=3, step=0)
    assert sample(logits, [other, spec, other])[1] == alone  # same draw in any batch position
    assert 0 <= alone < 1000
    # 20 steps of one huge seed differ (20 equal uniform draws over 1000: 1000**-19)
    steps = [SamplingSpec(temperature=1.0, seed=seed, step=s) for s in range(20)]
    assert len({sample(logits[:1], [spec])[0] for spec in steps}) > 10


def test_smallest_temperature_on_huge_logits_is_the_argmax():
    # 1e35 / 1e-4 overflows float32 to inf; the t -> 0 limit of sampling is the argmax (hand: 1)
    logits = torch.tensor([[0.0, 1e35, 1.0, -1e35]])
    assert sample(logits, [SamplingSpec(temperature=1e-4, seed=1)]) == [1]
    assert sample(logits, [SamplingSpec(temperature=1e-4, seed=None)]) == [1]


def test_check_params():
    assert check_params(None) == SamplingParams()
    p = SamplingParams(max_tokens=3)
    assert check_params(p) is p
    with pytest.raises(InvalidRequestError, match=r"dict.*SamplingParams\(max_tokens=3\)"):
        check_params({"max_tokens": 3})
    with pytest.raises(InvalidRequestError, match="got int"):
        check_params(3)
    p.temperature = NAN  # changed after construction: caught again at submission
    with pytest.raises(InvalidRequestError, match="temperature=nan"):
        check_params(p)


# ---------------------------------------------------------------- EngineConfig


def _total_ram_gb() -> float:
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return kib / 2**20


@pytest.mark.parametrize("settings, match", [
    ({"tp": True}, r"tp=True.*bool"), ({"dp": 2.0}, r"dp=2\.0.*integer"),
    ({"block_size": 1.5}, r"block_size=1\.5.*integer"),
    ({"kv_cache_gb": "1"}, r"kv_cache_gb='1'.*number"),
    ({"kv_cache_gb": INF}, r"kv_cache_gb=inf.*finite"), ({"kv_cache_gb": NAN}, r"kv_cache_gb=nan"),
    ({"kv_cache_gb": -1}, r"kv_cache_gb=-1"), ({"max_model_len": 0}, r"max_model_len=0.*positive"),
    ({"max_model_len": -5}, r"max_model_len=-5"), ({"num_threads": -1}, r"num_threads=-1.*None"),
    ({"num_threads": 0}, r"num_threads=0"), ({"init_timeout_s": 0}, r"init_timeout_s=0.*positive"),
    ({"step_timeout_s": -1.0}, r"step_timeout_s=-1\.0"),
    ({"collective_timeout_s": NAN}, r"collective_timeout_s=nan"),
    ({"step_timeout_s": INF}, r"step_timeout_s=inf"),
    ({"max_num_seqs": True}, r"max_num_seqs=True"),
    ({"max_num_batched_tokens": "8"}, r"max_num_batched_tokens='8'"),
    ({"enable_prefix_caching": "no"}, r"enable_prefix_caching='no'.*True or False"),
    ({"retry_on_rank_failure": 1}, r"retry_on_rank_failure=1.*True or False"),
    ({"shared_memory_all_reduce": "false"}, r"shared_memory_all_reduce=.false..*True or False"),
    ({"device": 0}, r"device=0"), ({"device": "cuda:x"}, r"device='cuda:x'"),
    ({"ray_address": 6379}, r"ray_address=6379"), ({"model": ""}, r"model=''"),
    ({"dtype": ["float32"]}, r"dtype=\['float32'\]"),
    ({"dtype": torch.float64}, r"dtype=torch\.float64: use one of"),
    ({"tp": np.float64(1.0)}, r"tp=np\.float64\(1\.0\) is a float64: use a positive integer"),
    ({"kv_cache_gb": np.float32("inf")}, r"kv_cache_gb=np\.float32\(inf\).*finite"),
])
def test_bad_settings_are_refused(settings, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig.from_kwargs(**settings)


def test_kv_cache_larger_than_memory_is_refused():
    too_big = 2 * _total_ram_gb()
    with pytest.raises(ConfigError, match=r"kv_cache_gb=.*GiB of memory"):
        EngineConfig.from_kwargs(kv_cache_gb=too_big)
    EngineConfig.from_kwargs(kv_cache_gb=_total_ram_gb() / 4)  # a quarter of RAM is fine


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused():
    with pytest.raises(ConfigError, match=r"device='cuda'.*not available.*device='cpu'"):
        EngineConfig.from_kwargs(device="cuda")


def test_good_settings_pass(tmp_path):
    cfg = EngineConfig.from_kwargs(kv_cache_gb=1, init_timeout_s=5, max_model_len=32,
                                   num_threads=1, device="cpu", model=tmp_path)
    assert cfg.kv_cache_gb == 1 and cfg.model == str(tmp_path)  # a Path names a model too


def test_a_torch_dtype_and_numpy_numbers_are_taken_as_the_settings_they_mean():
    given = EngineConfig.from_kwargs(
        dtype=torch.bfloat16, tp=np.int64(1), num_threads=np.int32(2),
        kv_cache_gb=np.float32(0.25), max_num_batched_tokens=np.int64(512),
        init_timeout_s=np.int64(5), cpus_per_rank=np.float64(1))
    plain = EngineConfig.from_kwargs(
        dtype="bfloat16", tp=1, num_threads=2, kv_cache_gb=0.25, max_num_batched_tokens=512,
        init_timeout_s=5, cpus_per_rank=1.0)
    assert given == plain and given.torch_dtype == torch.bfloat16
    for name in ("dtype", "tp", "num_threads", "kv_cache_gb", "max_num_batched_tokens",
                 "init_timeout_s", "cpus_per_rank"):
        assert type(getattr(given, name)) is type(getattr(plain, name)), name


# ---------------------------------------------------------------- prompts

LIMITS = PromptLimits("m", vocab_size=300, max_model_len=64)


@pytest.mark.parametrize("prompt, match", [
    ([True, 5], r"token id True at position 0 is a bool"),
    ([3, False], r"token id False at position 1 is a bool"),
    ([1.0, 2.0], r"token id 1\.0 at position 0 is a float.*int"),
    ([1, 2.5], r"token id 2\.5 at position 1 is a float"),
])
def test_bad_token_ids(prompt, match):
    with pytest.raises(InvalidRequestError, match=match):
        prompt_token_ids(prompt, None, LIMITS)


def test_numpy_token_ids_are_plain_ints():
    np = pytest.importorskip("numpy")
    assert prompt_token_ids(list(np.array([4, 5], dtype=np.int64)), None, LIMITS) == [4, 5]


def test_lone_surrogate_is_an_invalid_request():
    from engine.loading.checkpoint import open_checkpoint
    from engine.loading.tokenizer import load_tokenizer

    tok = load_tokenizer(open_checkpoint("smollm2"))  # metadata and vocabulary only
    with pytest.raises(InvalidRequestError, match=r"lone surrogate .\\ud800. at position 3.*UTF-8"):
        prompt_token_ids("abc\ud800", tok, LIMITS)


# ---------------------------------------------------------------- the engine, TP=1


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    with LLM(str(tiny_model_dir("qwen2")), max_model_len=64) as llm:
        good = [7, 8, 9, 10, 11]
        yield llm, good, llm.generate([good], SamplingParams(max_tokens=4))[0].token_ids


@pytest.mark.parametrize("prompts, params, match", [
    ([[7, 8, 9]], {"max_tokens": 3}, "dict"),
    ([[7, True, 9]], None, "bool"),
    ([[7.0, 8.0]], None, "float"),
    ([7, 8.0], None, "float"),
])
def test_engine_refuses_then_serves(tiny, prompts, params, match):
    llm, good, tokens = tiny
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(prompts, params)
    assert llm.generate([good], SamplingParams(max_tokens=4))[0].token_ids == tokens
    assert llm.cache_stats()["blocks_used"] == 0


def test_engine_serves_huge_seeds(tiny):
    llm, good, _ = tiny
    p = SamplingParams(max_tokens=5, temperature=0.9, seed=BIG_SEED, ignore_eos=True)
    first = llm.generate([good], p)[0].token_ids
    assert len(first) == 5 and llm.generate([good], p)[0].token_ids == first


# ---------------------------------------------------------------- model configs


def _with_config(src, dst, edit):
    shutil.copytree(src, dst)
    path = dst / "config.json"
    path.write_text(edit(json.loads(path.read_text())))
    return dst


def _set(**kv):
    return lambda cfg: json.dumps({**cfg, **kv})


def _drop(key):
    return lambda cfg: json.dumps({k: v for k, v in cfg.items() if k != key})


@pytest.mark.parametrize("edit, match", [
    (lambda cfg: json.dumps(cfg)[:-7], r"config.json.*not valid JSON.*line"),
    (lambda cfg: "[1, 2]", r"config.json.*JSON list, not the JSON object"),
    (_set(num_attention_heads=0), r"config.json.*num_attention_heads=0.*positive"),
    (_set(hidden_size="64"), r"config.json.*hidden_size='64'.*integer"),
    (_set(hidden_size=-64), r"config.json.*hidden_size=-64"),
    (_set(num_hidden_layers=2.5), r"num_hidden_layers=2\.5"),
    (_set(vocab_size=True), r"vocab_size=True"),
    (_set(num_key_value_heads=3), r"num_attention_heads=4.*multiple of num_key_value_heads=3"),
    (_set(num_attention_heads=5, num_key_value_heads=5), r"hidden_size=64.*num_attention_heads=5"),
    (_set(head_dim=7), r"head_dim=7.*even"),
    (_set(rms_norm_eps=-1.0), r"rms_norm_eps=-1\.0"),
    (_set(rope_parameters={"rope_theta": "big"}), r"rope_theta='big'"),
    (_set(rope_parameters=None, rope_theta=0.0), r"rope_theta=0\.0"),
    (_set(rope_parameters=[1, 2]), r"rope_parameters=\[1, 2\].*object"),
    (_set(rope_parameters=None, rope_scaling="x"), r"rope_scaling='x'.*object"),
    (_set(tie_word_embeddings="false"), r"tie_word_embeddings='false'.*true or false"),
    (_set(num_key_value_heads=0), r"num_key_value_heads=0"),
    (_set(eos_token_id="x"), r"eos_token_id='x'"),
    (_set(max_position_embeddings=0), r"max_position_embeddings=0"),
    (_drop("num_attention_heads"), r"config.json.*lacks required key 'num_attention_heads'"),
])
def test_corrupt_hf_config(tiny_model_dir, tmp_path, edit, match):
    from engine.loading.checkpoint import open_checkpoint

    path = _with_config(tiny_model_dir("qwen2"), tmp_path / "m", edit)
    with pytest.raises(ModelLoadError, match=match):
        open_checkpoint(str(path))


def _llama3_rope(**kv):
    return lambda cfg: json.dumps({**cfg, "rope_parameters": {**cfg["rope_parameters"], **kv}})


@pytest.mark.parametrize("edit, match", [
    (_llama3_rope(factor=0), r"config.json \(rope_parameters\): factor=0"),
    (_llama3_rope(low_freq_factor=None), r"lacks required key 'low_freq_factor'"),
    (_llama3_rope(original_max_position_embeddings=64.5), r"original_max_position_embeddings=64"),
])
def test_corrupt_llama3_rope(tiny_model_dir, tmp_path, edit, match):
    from engine.loading.checkpoint import open_checkpoint

    path = _with_config(tiny_model_dir("llama"), tmp_path / "m", edit)
    with pytest.raises(ModelLoadError, match=match):
        open_checkpoint(str(path))


@pytest.fixture(scope="module")
def smollm2_meta():
    from engine.loading.checkpoint import open_checkpoint

    return dict(open_checkpoint("smollm2").metadata)  # SmolLM2: 9 heads, 3 KV heads


@pytest.mark.parametrize("key, value, match", [
    ("llama.attention.head_count", 0, r"llama.attention.head_count=0"),
    ("llama.embedding_length", -1, r"llama.embedding_length=-1"),
    ("llama.attention.head_count_kv", 4, r"multiple of llama.attention.head_count_kv=4"),
    ("llama.block_count", "30", r"llama.block_count='30'"),
    ("llama.attention.layer_norm_rms_epsilon", NAN, r"layer_norm_rms_epsilon=nan"),
    ("llama.vocab_size", None, r"lacks required key 'llama.vocab_size'"),
])
def test_corrupt_gguf_metadata(smollm2_meta, key, value, match):
    from engine.loading.model_config import from_gguf_metadata

    with pytest.raises(ModelLoadError, match=match):
        from_gguf_metadata({**smollm2_meta, key: value}, False, "x.gguf")


# ---------------------------------------------------------------- TP=2


def test_bad_values_never_reach_a_tp_group(ray_cluster, tiny_model_dir):
    """Before: a mutated NaN temperature or a time_ns() seed raised on rank 0, the group was
    taken for broken and every later request got RankFailure. Now the driver refuses the NaN and
    the huge seed samples the same tokens as TP=1."""
    path, ids = str(tiny_model_dir("uneven")), [5, 17, 33, 9, 120]
    good = SamplingParams(max_tokens=6, temperature=0.8, top_k=50, seed=BIG_SEED, ignore_eos=True)
    with LLM(path, tp=2) as llm:
        bad = SamplingParams(temperature=0.8, seed=1)
        bad.temperature = NAN
        with pytest.raises(InvalidRequestError, match="temperature=nan"):
            llm.generate([ids], bad)
        with pytest.raises(InvalidRequestError, match="dict"):
            llm.generate([ids], {"temperature": math.inf})
        got = llm.generate([ids], good)[0].token_ids
        assert llm.cache_stats()["blocks_used"] == 0
    with LLM(path) as one:
        assert got == one.generate([ids], good)[0].token_ids
