"""The plan the driver resolves once: KV pool sizing (including the CUDA rule, computed here
from given numbers) and the block count every rank then holds."""
from __future__ import annotations

import pytest

from engine import ConfigError
from engine.config import EngineConfig
from engine.loading.checkpoint import open_checkpoint
from engine.plan import GPU_HEADROOM, kv_pool_bytes, make_plan

GIB = 2**30


def test_kv_pool_as_set_else_half_a_gib_on_cpu_else_free_gpu_memory_after_weights():
    assert kv_pool_bytes(0.25, on_cuda=True, free_bytes=80 * GIB, weight_bytes=GIB) == GIB // 4
    assert kv_pool_bytes(None, on_cuda=False, free_bytes=0, weight_bytes=GIB) == GIB // 2
    # an 8B model in bf16 on one 80 GiB GPU: 16 GiB of weights, 64 GiB left, 15 % kept back
    got = kv_pool_bytes(None, on_cuda=True, free_bytes=80 * GIB, weight_bytes=16 * GIB)
    assert got == int(64 * GIB * (1 - GPU_HEADROOM)) and GPU_HEADROOM == 0.15
    with pytest.raises(ConfigError, match="less than this rank's 16.0 GiB of weights"):
        kv_pool_bytes(None, on_cuda=True, free_bytes=10 * GIB, weight_bytes=16 * GIB)


def test_block_count_by_hand_for_smollm2_at_tp1_and_tp2():
    ckpt = open_checkpoint("smollm2")
    plan = make_plan(EngineConfig(), "smollm2", ckpt.config)
    # k+v, 30 layers, 3 KV heads of 64, float32, 16 tokens a block
    assert plan.num_blocks == GIB // 2 // (2 * 30 * 3 * 64 * 4 * 16) == 728
    plan = make_plan(EngineConfig(tp=2), "smollm2", ckpt.config)
    assert plan.num_blocks == GIB // 2 // (2 * 30 * 2 * 64 * 4 * 16)  # the rank with 2 KV heads
    assert [h.num_q_heads for h in plan.heads] == [6, 3] and plan.backend == "torch"


@pytest.mark.parametrize("onednn_bf16", [True, False])
def test_compile_unset_is_on_for_cuda_and_for_a_one_rank_cpu_engine(monkeypatch, onednn_bf16):
    """compile=None: CUDA compiles (not with cp > 1); a CPU compiles a one-rank engine that
    times its kernels (its weights quantized or not), in float32 always and in bfloat16 on a
    CPU whose oneDNN multiplies bf16; a set value always stands."""
    from engine.plan import COMPILE_ENV, compiles
    from engine.rank import gemm

    monkeypatch.setattr(gemm, "HAVE_ONEDNN_BF16", onednn_bf16)
    monkeypatch.delenv(COMPILE_ENV, raising=False)  # the suite's conftest sets it

    def decided(**settings) -> bool:
        return compiles(EngineConfig.from_kwargs(model="smollm2", **settings))

    assert decided(dtype="bfloat16") is onednn_bf16
    assert decided(dtype="bfloat16", compile=True) and not decided(dtype="bfloat16", compile=False)
    assert decided() and decided(weights="int4") and not decided(compile=False)  # float32
    assert not decided(dtype="float16")
    assert decided(dtype="bfloat16", weights="int4") is onednn_bf16
    for other in (dict(tp=2), dict(cp=2, enable_prefix_caching=False), dict(kernel_choice="fixed")):
        assert not decided(**other) and not decided(dtype="bfloat16", **other), other
    # (built unchecked: this torch has no CUDA to validate against)
    assert compiles(EngineConfig(device="cuda")) and not compiles(EngineConfig(device="cuda", cp=2))


def test_compile_env_keeps_unset_cpu_engines_eager(monkeypatch):
    """PREFILL_ENGINE_COMPILE=0: a CPU engine whose compile is unset runs eagerly, one that
    sets it and a CUDA one are not affected; another value is refused, naming the fix."""
    from engine.plan import COMPILE_ENV, compiles

    monkeypatch.setenv(COMPILE_ENV, "0")
    assert not compiles(EngineConfig()) and not compiles(EngineConfig(dtype="bfloat16"))
    assert compiles(EngineConfig(compile=True)) and compiles(EngineConfig(device="cuda"))
    monkeypatch.setenv(COMPILE_ENV, "off")
    with pytest.raises(ConfigError, match="PREFILL_ENGINE_COMPILE='off': set it to 0"):
        compiles(EngineConfig())
    assert compiles(EngineConfig(compile=True))  # a set compile never reads it
