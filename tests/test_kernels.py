"""Triton kernels against their torch references and the engine's own torch paths
(engine.rank.attention.torch_attention, engine.rank.model.RMSNorm, engine.rank.rotary.RotaryEmbedding): compiled on
a CUDA GPU when there is one, else under the CPU interpreter.

Shapes are tiny on purpose: the interpreter costs about a millisecond per program instance.
"""
import os

import torch  # importing torch does not import triton, so the variable below still takes effect

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: see _interpreted

from dataclasses import dataclass

import pytest
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from engine.rank.attention import torch_attention
from engine.rank.step_metadata import StepMetadata, build_step_metadata
from engine.rank.kernels import (decode_attention, flash_attention, kv_store, rmsnorm, rope,
                            silu_mul)
from engine.rank.kv_cache import KVCache
from engine.loading.model_config import ModelConfig
from engine.rank.rotary import RotaryEmbedding

# error allowed (absolute and relative), per dtype. bf16 keeps 8 significant bits, and the
# interpreter casts fp32 -> bf16 by truncation where torch and the GPU round to nearest, so bf16
# results may differ from torch's by one bf16 ulp (2**-7 relative) on top of summation order.
ATOL_INTERPRETER = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# Compiled on a GPU, from the interpreter's numbers: fp32 stays, since the kernels ask for IEEE
# fp32 dots and torch's references use neither TF32 matmuls (off by default) nor TF32 attention.
# fp16 stays: tensor cores accumulate fp16 products exactly in fp32 and round once to nearest,
# as torch does, so two implementations differ by about an fp16 ulp (2**-10), well inside it.
# bf16 tightens from 3e-2 to 2e-2: the GPU rounds fp32 -> bf16 to nearest, so the interpreter's
# truncation ulp becomes half an ulp (2**-9); what is left is one rounding on each side plus
# probabilities rounded to bf16 before the P @ V dot (as torch's fused SDPA also does), about
# 1e-2 at worst on these O(1) values, with margin for summation order.
ATOL_GPU = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
ATOL = ATOL_GPU if DEVICE == "cuda" else ATOL_INTERPRETER


def _close(actual: torch.Tensor, expected: torch.Tensor,
           precision: torch.dtype | None = None) -> None:
    """precision: the narrowest dtype the values passed through (default: their own)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = ATOL[precision or actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.fixture(autouse=True)
def _interpreted():
    """@triton.jit picks the interpreter when it decorates, and triton.language's own helpers
    (tl.zeros, tl.sum, ...) are decorated when triton is first imported. Re-importing triton is
    not safe, so if anything in this process imported it before TRITON_INTERPRET was set, say
    so instead of failing obscurely. On a GPU the kernels must be the compiled kind instead: the
    interpreter there would read CUDA tensors as host memory."""
    kernels = [flash_attention._flash_prefill_kernel, decode_attention._decode_split_kernel,
               decode_attention._decode_merge_kernel, kv_store._kv_store_kernel,
               rmsnorm._rmsnorm_kernel, rope._rope_kernel, silu_mul._silu_mul_kernel, tl.zeros]
    interpreted = [isinstance(k, InterpretedFunction) for k in kernels]
    if DEVICE == "cpu" and not all(interpreted):
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set; run this file in its "
                    "own process or set the variable in tests/conftest.py")
    if DEVICE == "cuda" and any(interpreted):
        pytest.fail("TRITON_INTERPRET=1 is set on a machine with a GPU; unset it so the kernels "
                    "are compiled and run on the GPU")


@dataclass
class PagedCase:
    """A packed batch over a paged cache whose every slot starts random, so a sequence's cached
    prefix (context_len > q_len) is already in place and stray reads would show."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    meta: StepMetadata
    caches: list[KVCache]  # identical copies, one per implementation under comparison


def _paged_case(q_lens: list[int], context_lens: list[int], kv_head_of_q: list[int],
                num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
                copies: int = 3, seed: int = 0) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, not in order
    tables, slots, cu = [], [], [0]
    for q_len, ctx in zip(q_lens, context_lens):
        n = -(-ctx // block_size)
        table, order = order[:n], order[n:]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(ctx - q_len, ctx)]
        cu.append(cu[-1] + q_len)
    meta = build_step_metadata(cu, context_lens, tables, slots, kv_head_of_q, DEVICE)
    layers = 2
    init = torch.randn(2, layers, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    caches = []
    for _ in range(copies):
        cache = KVCache(layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, DEVICE)
        cache.data.copy_(init)
        caches.append(cache)
    # q/k/v as views of one fused projection, strided like the model's; drawn on the CPU so both
    # devices see the same values
    hq, t = len(kv_head_of_q), cu[-1]
    qkv = torch.randn(t, (hq + 2 * num_kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([hq * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    return PagedCase(q.view(t, hq, head_dim), k.view(t, num_kv_heads, head_dim),
                     v.view(t, num_kv_heads, head_dim), meta, caches)


def _store_new_kv(c: PagedCase, layer: int) -> None:
    """Attention reads the new tokens' K/V from the cache: the engine stores them first (the
    store kernel has its own test below)."""
    for cache in c.caches:
        cache.store(layer, c.k, c.v, c.meta.slot_mapping)


PREFILL_CASES = {
    # name: q_lens, context_lens, kv_head_of_q, kv heads, head dim, dtype, block size
    "gqa-uneven-mixed-fp32": ([5, 20, 1], [5, 30, 9], [0, 0, 1], 2, 64, torch.float32, 4),
    "mqa-prefix-bf16": ([17, 3], [17, 40], [0, 0, 0, 0], 1, 128, torch.bfloat16, 4),
    "mha-d24-odd-block-fp32": ([33], [37], [0, 1], 2, 24, torch.float32, 5),
    "gqa-d32-bf16": ([7, 9], [7, 26], [0, 1, 1, 1], 2, 32, torch.bfloat16, 8),
    "decode-fp16": ([1, 1, 1], [7, 19, 2], [0, 0, 1], 2, 64, torch.float16, 4),
}


@pytest.mark.parametrize("name", PREFILL_CASES)
def test_flash_attention(name):
    c = _paged_case(*PREFILL_CASES[name])
    layer, scale = 1, c.q.shape[-1] ** -0.5
    _store_new_kv(c, layer)
    out = flash_attention.triton_attention(layer, c.q, c.k, c.v, c.caches[0], c.meta, scale)
    ref = flash_attention.paged_attention_reference(layer, c.q, c.caches[1], c.meta, scale)
    engine = torch_attention(layer, c.q, c.k, c.v, c.caches[2], c.meta, scale)
    _close(out, ref)
    _close(out, engine)


def test_flash_attention_tile_sizes():
    """Query tiles wider than the key tiles, and key tiles that straddle cache blocks."""
    c = _paged_case([30, 4], [35, 4], [0, 1, 1], 2, 64, torch.float32, 6)
    scale = 0.125
    _store_new_kv(c, 0)
    out = flash_attention.triton_attention(0, c.q, c.k, c.v, c.caches[0], c.meta, scale,
                                           block_m=32, block_n=16)
    _close(out, torch_attention(0, c.q, c.k, c.v, c.caches[1], c.meta, scale))


DECODE_CASES = {
    # name: context_lens, kv_head_of_q, kv heads, head dim, dtype, block size, kv_per_split
    "splits-gqa-uneven-fp32": ([5, 37, 1, 16], [0, 0, 1], 2, 64, torch.float32, 4, 16),
    "one-split-fp32": ([5, 37], [0, 1, 1], 2, 32, torch.float32, 4, None),
    "splits-mqa-bf16": ([50, 3], [0, 0, 0], 1, 128, torch.bfloat16, 8, 32),
    "splits-d24-fp16": ([17, 33], [0, 1, 0, 1], 2, 24, torch.float16, 5, 16),
}


@pytest.mark.parametrize("name", DECODE_CASES)
def test_decode_attention(name):
    ctx, mapping, hkv, d, dtype, block_size, per_split = DECODE_CASES[name]
    c = _paged_case([1] * len(ctx), ctx, mapping, hkv, d, dtype, block_size)
    layer, scale = 0, d ** -0.5
    _store_new_kv(c, layer)
    out = decode_attention.triton_decode_attention(layer, c.q, c.k, c.v, c.caches[0], c.meta,
                                                   scale, kv_per_split=per_split)
    ref = flash_attention.paged_attention_reference(layer, c.q, c.caches[1], c.meta, scale)
    engine = torch_attention(layer, c.q, c.k, c.v, c.caches[2], c.meta, scale)
    _close(out, ref)
    _close(out, engine)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_store(dtype):
    c = _paged_case([3, 6], [10, 6], [0, 1, 2], 3, 24, dtype, 4, copies=2)
    kv_store.triton_kv_store(c.caches[0], 1, c.k, c.v, c.meta.slot_mapping)  # strided k/v views
    kv_store.kv_store_reference(c.caches[1], 1, c.k, c.v, c.meta.slot_mapping)
    assert torch.equal(c.caches[0].data, c.caches[1].data)


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32),
                                             (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [48, 64])
def test_rmsnorm(x_dtype, w_dtype, with_residual, hidden):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, hidden, generator=gen).to(DEVICE, x_dtype)
    residual = (torch.randn(5, hidden, generator=gen).to(DEVICE, x_dtype) if with_residual
                else None)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(DEVICE, w_dtype)
    out, new_residual = rmsnorm.triton_rmsnorm(x, residual, weight, 1e-6)
    ref, ref_residual = rmsnorm.rmsnorm_reference(x, residual, weight, 1e-6)
    if with_residual:
        _close(new_residual, ref_residual)
        _close(new_residual, x + residual)
    else:
        assert new_residual is x
    _close(out, ref, x_dtype)  # an fp32 weight gives fp32 output of a row rounded to x's dtype
    # the formula written out, independent of both implementations
    total = (x if residual is None else x + residual).float()
    by_hand = weight.float() * (total / total.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt())
    _close(out.float(), by_hand, torch.bfloat16 if torch.bfloat16 in (x_dtype, w_dtype) else x_dtype)


def _rope_tables(head_dim: int, max_positions: int) -> RotaryEmbedding:
    cfg = ModelConfig(architecture="llama", hidden_size=4 * head_dim, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=head_dim, intermediate_size=8, vocab_size=8,
                      rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=max_positions,
                      tie_word_embeddings=False)
    return RotaryEmbedding(cfg, max_positions).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [24, 64])
@pytest.mark.parametrize("inplace", [False, True])
def test_rope(dtype, head_dim, inplace):
    gen = torch.Generator().manual_seed(2)
    emb = _rope_tables(head_dim, 64)
    t, hq, hkv = 7, 3, 2
    qk = torch.randn(t, (hq + hkv) * head_dim, generator=gen).to(DEVICE, dtype)
    q, k = (x.view(t, -1, head_dim) for x in qk.split([hq * head_dim, hkv * head_dim], dim=1))
    positions = torch.tensor([0, 1, 2, 40, 41, 63, 5], device=DEVICE)
    ref_q, ref_k = rope.rope_reference(positions, q, k, emb.cos, emb.sin)
    # position 0 is the identity rotation, whatever the implementation
    _close(ref_q[0], q[0])
    out_q, out_k = rope.triton_rope(positions, q, k, emb.cos, emb.sin, inplace=inplace)
    if inplace:
        assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    for out, ref in ((out_q, ref_q), (out_k, ref_k)):
        _close(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype):
    gen = torch.Generator().manual_seed(3)
    gate_up = (3 * torch.randn(6, 80, generator=gen)).to(DEVICE, dtype)
    out = silu_mul.triton_silu_mul(gate_up, block=16)  # 40 columns: three blocks, one partial
    _close(out, silu_mul.silu_mul_reference(gate_up))


# tp=2 needs two ranks: on a CPU they share it over gloo, but a GPU machine may hold one GPU (the
# lent H200 does). Ranks talking to each other are checked in tests/test_tensor_parallel.py; what
# this file checks on a GPU is the kernels.
ENGINE_TP = [1] if DEVICE == "cuda" else [1, 2]
# The engine's own defaults differ by device (bfloat16 on CUDA): compare in float32 everywhere,
# so the tolerance below is the same on both.
ENGINE_DEVICE = {"device": "cuda", "dtype": "float32"} if DEVICE == "cuda" else {}


@pytest.mark.parametrize("tp", ENGINE_TP)
def test_engine_with_triton_backend_matches_torch(tiny_model_dir, request, tp):
    """The whole engine on the Triton kernels (interpreted on a CPU) picks the same greedy tokens
    as on torch, through a prefill, a chunked prefill over a cached prefix, and decode steps."""
    from engine import LLM, SamplingParams

    if tp > 1:
        request.getfixturevalue("ray_cluster")
    path = str(tiny_model_dir("qwen2"))
    prompts = [list(range(3, 40)), list(range(3, 30)) + [5, 6, 7]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        with LLM(path, tp=tp, attention_backend=backend, max_num_batched_tokens=24,
                 **ENGINE_DEVICE) as llm:
            results[backend] = [g.token_ids for g in llm.generate(prompts, params)]
            logits = llm.prefill([prompts[1]])[0].logits  # its first 16 tokens are cached
            results[backend + "_logits"] = logits
    assert results["triton"] == results["torch"]
    torch.testing.assert_close(results["triton_logits"], results["torch_logits"], atol=1e-4, rtol=1e-4)
