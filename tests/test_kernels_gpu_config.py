"""The attention kernels at the tile and split sizes a GPU runs by default (config.GPU_DEFAULTS),
under the interpreter here: head dims 64 and 128, several query tiles and at least three key
tiles per sequence, prefix plus chunk (q_len < kv_len), packed sequences, 16-bit dtypes.
References: the plain-torch gather in flash_attention.paged_attention_reference and the engine's
SDPA path (engine.rank.attention.torch_attention).
"""
import pytest
import torch

from tests.test_kernels import DEVICE, _close, _paged_case, _store_new_kv  # sets TRITON_INTERPRET

from engine.rank.attention import torch_attention  # noqa: E402
from engine.rank.kernels import launch_config as config, decode_attention, flash_attention  # noqa: E402
from engine.rank.step_metadata import build_step_metadata, split_length  # noqa: E402

GPU = config.GPU_DEFAULTS


def _step(c, defaults=GPU):
    m = c.meta
    return build_step_metadata(m.cu_seqlens_q, m.context_lens, m.block_tables, m.slot_mapping,
                               m.kv_head_of_q.tolist(), DEVICE, defaults=defaults)


def test_one_set_of_gpu_defaults():
    """The CUDA path, the autotuner's first config and the interpreter's single config are all
    GPU_DEFAULTS, so the tests below run what a GPU runs when it does not tune."""
    assert config.defaults_for("cuda") is GPU
    m, n, warps, stages = config.PREFILL_TUNE_SPACE[0]
    assert (m, n, warps, stages) == (GPU.prefill_block_m, GPU.prefill_block_n,
                                     GPU.prefill_num_warps, GPU.prefill_num_stages)
    if DEVICE == "cpu":
        [only] = flash_attention._TUNE_CONFIGS
        assert only.kwargs == {"BLOCK_M": m, "BLOCK_N": n}
        assert (only.num_warps, only.num_stages) == (warps, stages)
    assert GPU.decode_min_split % GPU.decode_block_n == 0


PREFILL_CASES = {
    # q_lens, context_lens, kv_head_of_q, kv heads, head dim, dtype, block size
    # GQA 4:1 as in Llama 3: 32 tokens per 128-row tile; a 150-token prompt (5 tiles), a
    # 40-token chunk after a 190-token prefix (4 key tiles of 64), and a decode row
    "d128-gqa4-bf16": ([40, 150, 1], [230, 150, 70], [0, 0, 0, 0, 1, 1, 1, 1], 2, 128,
                       torch.bfloat16, 16),
    # uneven groups (a TP rank's 3+1 heads): group width 4, one padded row per token in KV head 1
    "d64-uneven-fp16": ([70, 9], [200, 139], [0, 0, 0, 1], 2, 64, torch.float16, 16),
    "d64-mha-fp32": ([33, 64, 2], [161, 64, 131], [0, 1], 2, 64, torch.float32, 16),
}


@pytest.mark.parametrize("name", PREFILL_CASES)
def test_prefill_at_gpu_defaults(name):
    c = _paged_case(*PREFILL_CASES[name])
    assert max(c.meta.context_lens) > 2 * GPU.prefill_block_n  # at least three key tiles
    layer, scale = 1, c.q.shape[-1] ** -0.5
    _store_new_kv(c, layer)
    # autotune=True: the autotuner itself, which under the interpreter holds one config
    out = flash_attention.triton_attention(layer, c.q, c.k, c.v, c.caches[0], _step(c), scale,
                                           autotune=True)
    ref = flash_attention.paged_attention_reference(layer, c.q, c.caches[1], c.meta, scale)
    _close(out, ref)
    _close(out, torch_attention(layer, c.q, c.k, c.v, c.caches[2], c.meta, scale))


TUNED_TILES = sorted({(m, n) for m, n, _, _ in config.PREFILL_TUNE_SPACE})


@pytest.mark.parametrize("block_m,block_n", TUNED_TILES)
def test_prefill_at_every_tile_the_autotuner_may_pick(block_m, block_n):
    """Any tile the GPU's autotuner may choose computes the same attention (warps and stages
    change the schedule, not the arithmetic, so the tile sizes are what can break)."""
    c = _paged_case(*PREFILL_CASES["d64-uneven-fp16"])
    layer, scale = 1, c.q.shape[-1] ** -0.5
    _store_new_kv(c, layer)
    out = flash_attention.triton_attention(layer, c.q, c.k, c.v, c.caches[0], _step(c), scale,
                                           block_m=block_m, block_n=block_n)
    _close(out, flash_attention.paged_attention_reference(layer, c.q, c.caches[1], c.meta, scale))


DECODE_CASES = {
    # context_lens, kv_head_of_q, kv heads, head dim, dtype, kv_per_split (None: the step's)
    # three 256-key splits of 64-key tiles for the longest sequence, one for the shortest
    "d128-gpu-splits-bf16": ([700, 300, 5, 64], [0, 0, 0, 0, 1, 1, 1, 1], 2, 128,
                             torch.bfloat16, GPU.decode_min_split),
    "d64-gpu-splits-fp16": ([520, 257], [0, 0, 1], 2, 64, torch.float16, GPU.decode_min_split),
    # split lengths the old kernel refused next to a 64-key tile (it asserted divisibility)
    "split-16-fp32": ([70, 33], [0, 1], 2, 64, torch.float32, 16),
    "split-32-bf16": ([90, 7], [0, 0, 0, 0], 1, 128, torch.bfloat16, 32),
    "split-100-fp32": ([301, 100, 99], [0, 0, 1], 2, 64, torch.float32, 100),
    "one-split-fp32": ([150, 3], [0, 1, 1], 2, 64, torch.float32, None),
}


@pytest.mark.parametrize("name", DECODE_CASES)
def test_decode_at_gpu_defaults(name):
    ctx, mapping, hkv, d, dtype, per_split = DECODE_CASES[name]
    c = _paged_case([1] * len(ctx), ctx, mapping, hkv, d, dtype, 16)
    layer, scale = 0, d ** -0.5
    _store_new_kv(c, layer)
    out = decode_attention.triton_decode_attention(layer, c.q, c.k, c.v, c.caches[0], _step(c),
                                                   scale, kv_per_split=per_split)
    ref = flash_attention.paged_attention_reference(layer, c.q, c.caches[1], c.meta, scale)
    _close(out, ref)
    _close(out, torch_attention(layer, c.q, c.k, c.v, c.caches[2], c.meta, scale))


@pytest.mark.parametrize("sms,seqs,kv_heads,max_kv,expected", [
    # splits = ceil(2 * sms / (seqs * kv_heads)); keys = ceil(max_kv / splits), rounded up to a
    # multiple of 64, at least 256 (worked by hand)
    (132, 1, 8, 8192, 256),     # 33 splits: 249 keys -> 256
    (132, 1, 1, 65536, 256),    # 264 splits: 249 -> 256
    (132, 64, 8, 4096, 4096),   # 1 split: the whole context
    (78, 2, 4, 100000, 5056),   # 20 splits: 5000 -> 79 tiles of 64
    (132, 1, 8, 300, 256),      # 33 splits: 10 keys -> 64 -> the 256 floor
])
def test_decode_split_length(sms, seqs, kv_heads, max_kv, expected):
    assert split_length(sms, GPU, seqs, kv_heads, max_kv) == expected


@pytest.mark.parametrize("group,smallest_kept", [(4, 64), (8, 64), (128, 128), (256, None)])
def test_autotune_prunes_tiles_too_small_for_a_group(group, smallest_kept):
    """The GPU's whole search space, pruned through Triton's own call of the prune hook (GROUP
    arrives as a keyword argument there): tiles narrower than a group go; if none is wide
    enough, the first config stays and the wrapper launches a widened tile itself."""
    tuner = flash_attention.prefill_autotuner(config.PREFILL_TUNE_SPACE)
    tuner.nargs = {}  # what Autotuner.run sets from the positional arguments before pruning
    kept = tuner.prune_configs({"GROUP": group, "HEAD_DIM": 128, "BLOCK_SIZE": 16})
    if smallest_kept is None:
        assert kept == tuner.configs[:1]
    else:
        assert min(c.kwargs["BLOCK_M"] for c in kept) == smallest_kept
        assert len(kept) == sum(m >= group for m, *_ in config.PREFILL_TUNE_SPACE)
