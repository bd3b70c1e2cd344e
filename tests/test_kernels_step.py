"""Per-step metadata (engine.rank.step_metadata): built once per step, read by every
layer with no host work; and offsets past 2**31 elements in the KV cache."""
import os
import sys

import pytest
import torch

from tests.test_kernels import DEVICE, _close, _paged_case  # sets TRITON_INTERPRET first

from engine.rank.attention import torch_attention  # noqa: E402
from engine.rank.backend import select_backend  # noqa: E402
from engine.rank.kernels import flash_attention, kv_store  # noqa: E402
from engine.rank.step_metadata import build_step_metadata  # noqa: E402
from engine.rank.kv_cache import KVCache  # noqa: E402


def test_step_metadata_layout():
    """Every field, worked out by hand, and all of them views of one device tensor."""
    step = build_step_metadata([0, 3, 4, 9], [10, 4, 12], [[7, 2, 5], [1], [0, 3, 4]],
                               [29, 22, 23, 4, 0, 1, 2, 3, 16], [0, 0, 1, 1, 1], DEVICE)
    assert step.cu_q.tolist() == [0, 3, 4, 9] and step.ctx.tolist() == [10, 4, 12]
    assert step.order.tolist() == [2, 0, 1]  # longest context first
    assert step.cu_sorted.tolist() == [0, 5, 8, 9]  # new tokens 5, 3, 1 in that order
    assert step.table.tolist() == [[7, 2, 5], [1, 0, 0], [0, 3, 4]]
    assert step.groups.tolist() == [[0, 1, -1, -1], [2, 3, 4, -1]]  # width: next power of 2
    assert step.slot_mapping.tolist() == [29, 22, 23, 4, 0, 1, 2, 3, 16]
    assert step.kv_head_of_q.tolist() == [0, 0, 1, 1, 1]
    assert (step.num_tokens, step.max_kv, step.num_kv_heads, step.is_decode) == (9, 12, 2, False)
    storages = {t.untyped_storage().data_ptr() for t in
                (step.cu_q, step.ctx, step.order, step.cu_sorted, step.table, step.groups,
                 step.slot_mapping, step.kv_head_of_q)}
    assert len(storages) == 1  # one host->device copy
    decode = build_step_metadata([0, 1, 2], [5, 9], [[0, 1], [2]], [4, 17], [0, 1], DEVICE)
    assert decode.is_decode and decode.decode_kv_per_split > 0


@pytest.fixture
def host_calls(monkeypatch):
    """Calls of host->device tensor constructors and device->host reads made from the rank's
    own modules (engine/rank/, kernels included); the interpreter's internals are not the
    layers' per-layer cost."""
    calls = []
    rank_dir = os.path.dirname(os.path.dirname(flash_attention.__file__))

    def counted(owner, name):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(rank_dir):
                calls.append(name)
            return original(*args, **kwargs)
        monkeypatch.setattr(owner, name, wrapper)

    for name in ("tensor", "as_tensor", "from_numpy"):
        counted(torch, name)
    for name in ("tolist", "item"):
        counted(torch.Tensor, name)
    return calls


def _layers(c, meta, num_layers: int, scale: float, backend: str = "triton") -> list[torch.Tensor]:
    """What the model does with attention in each layer: store the new K/V, then attend, through
    one of the engine's backends."""
    backend = select_backend(backend, DEVICE)
    attention = backend.decode_attention if meta.is_decode else backend.attention
    outs = []
    for layer in range(num_layers):
        backend.kv_store(c.caches[0], layer, c.k, c.v, meta.slot_mapping)
        outs.append(attention(layer, c.q, c.k, c.v, c.caches[0], meta, scale))
    return outs


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("decode", [False, True])
def test_no_host_tensors_per_layer(host_calls, decode, backend):
    q_lens = [1, 1, 1] if decode else [6, 20, 1]
    c = _paged_case(q_lens, [9, 40, 3], [0, 0, 1, 1], 2, 32, torch.float32, 4)
    m, scale, num_layers = c.meta, 32 ** -0.5, 2
    args = (m.cu_seqlens_q, m.context_lens, m.block_tables, m.slot_mapping.tolist(),
            m.kv_head_of_q.tolist(), DEVICE)
    step = build_step_metadata(*args)
    host_calls.clear()  # building the step's metadata is the one place they are allowed
    outs = _layers(c, step, num_layers, scale, backend)
    assert host_calls == []
    build_step_metadata(*args)  # the counter does see host tensors where they are made
    assert host_calls
    for layer, out in enumerate(outs):
        _close(out, torch_attention(layer, c.q, c.k, c.v, c.caches[0], c.meta, scale))


def _huge_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> KVCache:
    """A cache of more than 2**31 elements per layer, left uninitialised: only the pages a
    kernel touches ever get memory (KVCache() would zero all of it)."""
    cache = KVCache.__new__(KVCache)
    cache.block_size, cache.num_blocks = block_size, num_blocks
    cache.data = torch.empty(2, 1, num_blocks, block_size, kv_heads, head_dim,
                             dtype=torch.float16, device=DEVICE)
    return cache


def test_offsets_past_2_31():
    """K/V stored into and attention read from the last blocks of a cache whose element offsets
    pass 2**31 (4 GiB of fp16 per K or V, virtual): int32 offsets would wrap and write elsewhere."""
    block_size, heads, head_dim = 16, 1, 64
    per_block = block_size * heads * head_dim
    num_blocks = 2**31 // per_block + 4
    cache = _huge_cache(num_blocks, block_size, heads, head_dim)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(20, 2, head_dim, generator=gen).to(DEVICE, torch.float16)
    k, v = (torch.randn(20, heads, head_dim, generator=gen).to(DEVICE, torch.float16)
            for _ in range(2))
    table = [num_blocks - 3, num_blocks - 1]  # both past 2**31 / per_block
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                          for p in range(20)], device=DEVICE)
    assert int(slots.min()) * heads * head_dim > 2**31
    kv_store.triton_kv_store(cache, 0, k, v, slots)
    k_cache, v_cache = cache.layer(0)
    assert torch.equal(k_cache.view(-1, heads, head_dim)[slots], k)
    assert torch.equal(v_cache.view(-1, heads, head_dim)[slots], v)
    step = build_step_metadata([0, 20], [20], [table], slots, [0, 0], DEVICE)
    out = flash_attention.triton_attention(0, q, k, v, cache, step, head_dim ** -0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.transpose(0, 1).float().expand(2, -1, -1),
        v.transpose(0, 1).float().expand(2, -1, -1), is_causal=True, scale=head_dim ** -0.5)
    _close(out, ref.transpose(0, 1).to(torch.float16))


def test_step_metadata_does_not_import_triton():
    """The worker may build step metadata before deciding on (or without) the Triton backend;
    importing triton then would fix TRITON_INTERPRET off for the whole process."""
    import subprocess

    code = ("import sys; import engine.rank.step_metadata; "
            "sys.exit(1 if 'triton' in sys.modules else 0)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert subprocess.run([sys.executable, "-c", code], cwd=root).returncode == 0
