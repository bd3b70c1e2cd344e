"""engine.rank.quantized_layers: a decode step's layers as one C++ call (quantized_rows.cpp's
quantized_decode_layers) against float64 layers written here (RMSNorm, the weights dequantized by
hand from their codes, RoPE by its formula, softmax attention over each row's context read
through its block table, SiLU·mul), for int8 and int4 weights and float ones (a float model's
decode steps may take the call), float32 and bf16, rows past the products' 4 at a time, query
groups and biases; the KV cache holding each layer's rotated K and
V afterwards; refusals; an engine whose rows decode alike alone and in a batch of six; and
engines whose decode steps run it (tests/test_quantized_rows.py)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from engine.rank import fused_attention
from engine.rank import quantized_rows as qr
from engine.rank.quantized import int4_groups, int8_per_channel
from tests.engine_cache import fresh_cache
from tests.row_timings import certain_row_timings, fused_wins

HQ, HKV, HD, D, FFN = 4, 2, 32, 64, 96
BLOCK, BLOCKS, LAYERS = 4, 32, 2  # 4 blocks a row, none shared
EPS = 1e-5
# bound on |got - want| over the largest |want| (measured over this file's cases: float32 int8
# 5.5e-7, its float32 sums; float32 int4 4.5e-4, the int16 rounding of x per group; bf16 2.8e-2,
# its 2^-8 rounding at each of a layer's ~8 rounded steps, over two layers)
BOUND = {(torch.float32, "int8"): 5e-6, (torch.float32, "int4"): 1e-3,
         (torch.bfloat16, "int8"): 6e-2, (torch.bfloat16, "int4"): 6e-2,
         (torch.float32, "float"): 5e-6, (torch.bfloat16, "float"): 6e-2}
# "float": a float model's weight as it is (its decode steps may take the call too)
QUANTIZE = {"int8": int8_per_channel, "int4": int4_groups, "float": lambda weight: weight}


@pytest.fixture(autouse=True)
def _libraries():
    """The halves' kernels, and the attention's they call, registered (built if need be)."""
    assert qr.available("int4") and fused_attention.available()


def _dequantized(weight) -> torch.Tensor:
    """The float64 weight its codes stand for: int8 q s; int4 d q + m per group of 32, the
    group's code i in the low nibble of byte i and code i + 16 in the high one; a float weight
    as it is."""
    if isinstance(weight, torch.Tensor):
        return weight.double()
    if weight.kind == "int8":
        return weight.codes.double() * weight.scales.double()[:, None]
    n, k = weight.shape
    nibbles = weight.nibbles.view(n, k // 32, 16).long()
    codes = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).double()
    d, m = (weight.steps[i].double().view(n, k // 32, 1) for i in (0, 1))
    return (d * codes + m).view(n, k)


def _pair(weight) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(weight, torch.Tensor):  # a float weight: no scales
        return weight, weight.new_empty(0)
    if weight.kind == "int8":
        return weight.codes, weight.scales
    return weight.nibbles, weight.steps


def _norm(s, w):
    return w.double() * s / torch.sqrt((s * s).mean(-1, keepdim=True) + EPS)


def _rotated(t, cos, sin):
    half = t.shape[-1] // 2
    x1, x2 = t[..., :half], t[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class Layer:
    """One layer's norms, weights and biases."""

    def __init__(self, kind: str, rand, bias: bool):
        self.norms = 1 + rand(D, s=0.1), 1 + rand(D, s=0.1)
        self.qkv = QUANTIZE[kind](rand((HQ + 2 * HKV) * HD, D, s=0.2))
        self.o = QUANTIZE[kind](rand(D, HQ * HD, s=0.1))
        self.gate_up = QUANTIZE[kind](rand(2 * FFN, D, s=0.2))
        self.down = QUANTIZE[kind](rand(D, FFN, s=0.1))
        self.biases = (rand((HQ + 2 * HKV) * HD), rand(2 * FFN)) if bias else (None, None)


class Setup:
    """LAYERS layers, a cache with earlier context, and a decode step of `rows` rows."""

    def __init__(self, kind: str, dtype: torch.dtype, rows: int, bias: bool):
        gen = torch.Generator().manual_seed(rows + 7 * bias)
        rand = lambda *shape, s=1.0: (torch.randn(*shape, generator=gen) * s).to(dtype)
        self.dtype = dtype
        self.x = rand(rows, D)
        self.first_layer = 0  # the cache's layer of self.layers[0]
        self.layers = [Layer(kind, rand, bias) for _ in range(LAYERS)]
        angles = torch.outer(torch.arange(64.0), 1.0 / 10000 ** (torch.arange(0, HD, 2) / HD))
        self.cos, self.sin = angles.cos(), angles.sin()
        self.cache = rand(2, LAYERS, BLOCKS, BLOCK, HKV, HD)
        # row r: a context of lens[r] tokens over blocks of its own, in no order
        self.lens = [1 + (5 * r + 3) % 14 for r in range(rows)]
        order = torch.randperm(BLOCKS, generator=gen).tolist()
        self.table = [order[(r * 4) % BLOCKS:(r * 4) % BLOCKS + 4] for r in range(rows)]
        self.slots = [t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK
                      for t, n in zip(self.table, self.lens)]

    def run(self, positions: list[int] | None = None):
        """Every layer in one call: (the output, the residual)."""
        residual = torch.zeros_like(self.x)
        out = self._call(self.x, residual, self.layers, self.first_layer, 0,
                         2 * len(self.layers), positions)
        return out, residual

    def run_by_parts(self):
        """As a rank of tp > 1 calls it: a call per part (a layer's attention, its MLP), each
        given only its layer's tensors."""
        x, residual = self.x, torch.zeros_like(self.x)
        for part in range(2 * len(self.layers)):
            x = self._call(x, residual, self.layers[part // 2:part // 2 + 1], part // 2,
                           part % 2, 1)
        return x, residual

    def _call(self, x, residual, layers, first_layer, first_part, parts, positions=None):
        as_int = lambda v: torch.tensor(v, dtype=torch.int32)
        norms = [n for layer in layers for n in layer.norms]
        weights = [t for layer in layers
                   for w in (layer.qkv, layer.o, layer.gate_up, layer.down) for t in _pair(w)]
        biases = [b for layer in layers for b in layer.biases]
        positions = [n - 1 for n in self.lens] if positions is None else positions
        return qr.quantized_decode_layers(
            x, residual, norms, EPS, weights, biases, self.cos, self.sin, as_int(positions),
            self.cache, as_int(self.slots), as_int(self.table), as_int(self.lens), HQ, HD ** -0.5,
            first_layer, first_part, parts)

    def want(self, cache_before: torch.Tensor):
        """(the last layer's output, its residual, each layer's rotated new K and V [rows, HKV,
        HD]) in float64."""
        x, residual, new = self.x.double(), torch.zeros_like(self.x.double()), []
        for i, layer in enumerate(self.layers):
            residual = x + residual
            o, k, v = self._attention(i, layer, _norm(residual, layer.norms[0]), cache_before)
            new.append((k, v))
            residual = o + residual
            gate_up = _norm(residual, layer.norms[1]) @ _dequantized(layer.gate_up).T
            if layer.biases[1] is not None:
                gate_up = gate_up + layer.biases[1].double()
            gate, up = gate_up[:, :FFN], gate_up[:, FFN:]
            x = (gate * torch.sigmoid(gate) * up) @ _dequantized(layer.down).T
        return x, residual, new

    def _attention(self, index: int, layer: Layer, normed: torch.Tensor, cache: torch.Tensor):
        qkv = normed @ _dequantized(layer.qkv).T
        if layer.biases[0] is not None:
            qkv = qkv + layer.biases[0].double()
        outs, new_k, new_v = [], [], []
        flat = cache[:, index].reshape(2, -1, HKV, HD).double()
        for r, n in enumerate(self.lens):
            c, s = self.cos[n - 1].double(), self.sin[n - 1].double()
            heads = qkv[r].view(HQ + 2 * HKV, HD)
            q, k = _rotated(heads[:HQ], c, s), _rotated(heads[HQ:HQ + HKV], c, s)
            v = heads[HQ + HKV:]
            slots = [self.table[r][i // BLOCK] * BLOCK + i % BLOCK for i in range(n - 1)]
            keys = torch.cat([flat[0, slots], k[None]]).repeat_interleave(HQ // HKV, 1)
            values = torch.cat([flat[1, slots], v[None]]).repeat_interleave(HQ // HKV, 1)
            scores = torch.einsum("hd,nhd->hn", q, keys) / math.sqrt(HD)
            outs.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), values).flatten())
            new_k.append(k)
            new_v.append(v)
        o = torch.stack(outs) @ _dequantized(layer.o).T
        return o, torch.stack(new_k), torch.stack(new_v)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, kind: str) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    error = (got.double() - want).abs().max() / want.abs().max()
    assert error < BOUND[dtype, kind], f"{error:.2e} of the largest |value|"


@pytest.mark.parametrize("kind", ["int8", "int4", "float"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_layers_match_float64(kind, dtype, rows):
    setup = Setup(kind, dtype, rows, bias=rows == 3)
    before = setup.cache.clone()
    out, residual = setup.run()
    want, want_residual, new = setup.want(before)
    _close(out, want, dtype, kind)
    _close(residual, want_residual, dtype, kind)
    # each layer's new K (rotated) and V in their slots; nothing else in the cache moved
    for layer, (k, v) in enumerate(new):
        flat = setup.cache[:, layer].reshape(2, -1, HKV, HD)
        _close(flat[0, setup.slots], k, dtype, kind)
        _close(flat[1, setup.slots], v, dtype, kind)
    untouched = [s for s in range(BLOCKS * BLOCK) if s not in setup.slots]
    flat, flat_before = (c.view(2, LAYERS, -1, HKV, HD) for c in (setup.cache, before))
    assert torch.equal(flat[:, :, untouched], flat_before[:, :, untouched])


@pytest.mark.parametrize("kind", ["int8", "int4", "float"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_call_per_part_matches_float64_and_the_one_call(kind, dtype):
    """A rank of tp > 1 calls each layer's attention and MLP apart (the sum over ranks goes
    between): the same float64 bound, the same values as one call, the same cache."""
    setup = Setup(kind, dtype, 3, bias=True)
    before = setup.cache.clone()
    out, residual = setup.run_by_parts()
    want, want_residual, _ = setup.want(before)
    _close(out, want, dtype, kind)
    _close(residual, want_residual, dtype, kind)
    by_parts_cache = setup.cache.clone()
    setup.cache.copy_(before)
    whole, whole_residual = setup.run()
    assert torch.equal(out, whole) and torch.equal(residual, whole_residual)
    assert torch.equal(by_parts_cache, setup.cache)


def test_refusals_name_the_problem():
    setup = Setup("int4", torch.float32, 2, bias=False)
    layer = setup.layers[1]
    layer.gate_up, layer.o = layer.o, layer.gate_up  # o_proj's weight where gate/up's goes
    with pytest.raises(ValueError, match="o_proj takes 64 inputs, the layer gives it 128"):
        setup.run()
    layer.gate_up, layer.o = layer.o, layer.gate_up
    layer.norms = layer.norms[0].bfloat16(), layer.norms[1]
    with pytest.raises(ValueError, match="a norm's weight must be \\[64\\] of Float"):
        setup.run()
    layer.norms = layer.norms[0].float(), layer.norms[1]
    with pytest.raises(IndexError, match="position 64 outside the rotary tables' 64"):
        setup.run(positions=[0, 64])
    setup.slots[1] = BLOCKS * BLOCK  # one past the cache
    before = setup.cache.clone()
    with pytest.raises(IndexError, match="outside the KV cache"):
        setup.run()
    assert torch.equal(setup.cache, before)  # nothing written
    setup.slots[1] = 0
    setup.first_layer = 1  # two layers' tensors from the cache's second, of two
    with pytest.raises(ValueError, match=r"holding the listed layers \[1, 3\)"):
        setup.run()


def test_a_float_weight_not_of_the_activations_dtype_is_refused():
    """A float weight is multiplied as it is, so it must be of the activations' dtype (a bf16
    o_proj in a float32 step is refused, not read as float32), and takes no scales."""
    setup = Setup("float", torch.float32, 2, bias=False)
    setup.layers[1].o = setup.layers[1].o.bfloat16()
    with pytest.raises(ValueError, match=r"o_proj must be int8 codes .* or values \[n, k\] of "
                                         r"that dtype with an empty tensor for scales; got "
                                         r"BFloat16"):
        setup.run()


@pytest.mark.parametrize("gate_up,taken", [({"torch": 1.1e-3, "fused": 1.2e-3}, True),
                                           ({"torch": 1e-4, "fused": 9e-3}, False)])
def test_the_one_call_weighs_a_layers_products_together(tiny_model_dir, monkeypatch, tmp_path,
                                                        gate_up, taken):
    """torch's kernel a little faster for one projection shape alone (its product takes torch's)
    leaves the one call on, the other three being far slower with torch; much faster, so that
    torch's products are faster together, turns it off, and rank_info says why."""
    from engine import LLM

    config = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    outputs = 2 * config["intermediate_size"]
    certain_row_timings(monkeypatch, tmp_path, lambda w: (
        gate_up if w.shape[0] == outputs else fused_wins(w)))
    with LLM(str(tiny_model_dir("llama")), weights="int4", enable_prefix_caching=False) as llm:
        kernels = llm.rank_info()[0].kernels
    gate_up_pick = [k for k in kernels if k.startswith(f"int4-rows {outputs}x")]
    assert gate_up_pick and ": torch (" in gate_up_pick[0]
    if taken:
        assert "quantized-decode-layers: one C++ call a step" in kernels
    else:
        assert any(k.startswith("quantized-decode-layers: off (torch's products timed faster "
                                "together (") for k in kernels), kernels


def test_an_engines_rows_do_not_depend_on_their_batch(tiny_model_dir, monkeypatch, tmp_path):
    """Six sequences decoded in one batch (past the products' and the LM head's 4 rows at a
    time) get the tokens each gets alone: every row goes through the same kernels."""
    from engine import LLM, SamplingParams

    certain_row_timings(monkeypatch, tmp_path)
    prompts = [[(7 * i + 3 * j) % 200 + 3 for j in range(4 + 5 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(str(tiny_model_dir("llama")), weights="int4", dtype="bfloat16",
             enable_prefix_caching=False) as llm:
        assert "quantized-decode-layers: one C++ call a step" in llm.rank_info()[0].kernels
        alone = [llm.generate([p], params)[0].token_ids for p in prompts]
        assert [o.token_ids for o in llm.generate(prompts, params)] == alone


# a prompt step of two sequences, then decode steps at three lengths (tests/fake_cuda_run.py)
WORKER_STEPS = [(37, 0, 2), (1, 37, 2), (1, 140, 3), (1, 5, 1)]


def _worker_logits(model_dir: str, cache: str, rank: int, world: int, shared: bool,
                   kernel_choice: str) -> tuple:
    """A rank's Worker (int8 weights; "measure": the C++ row products certain to be picked),
    run through WORKER_STEPS: (each step's logits on rank 0, what its rank_info says)."""
    from engine.config import EngineConfig
    from engine.loading.checkpoint import open_checkpoint
    from engine.plan import make_plan
    from engine.rank.worker import Worker
    from tests.fake_cuda_run import make_batch

    certain_row_timings(pytest.MonkeyPatch(), cache)
    cfg = EngineConfig.from_kwargs(model=model_dir, tp=world, weights="int8", block_size=16,
                                   max_model_len=256, compile=False, kernel_choice=kernel_choice,
                                   shared_memory_all_reduce=shared)
    ckpt = open_checkpoint(model_dir)
    worker = Worker(make_plan(cfg, model_dir, ckpt.config), rank=rank, world_size=world,
                    checkpoint=ckpt)
    logits = []
    for steps in WORKER_STEPS:
        batch = make_batch(*steps)
        batch.return_logits = True
        result = worker.execute(batch)  # rank 0's; None on the others
        logits.append(result.logits if result is not None else None)
    info = worker.info()
    return logits, (info.all_reduce, [k for k in info.kernels if k.startswith("quantized-")])


def _tp2_ranks(rank: int, world: int, model_dir: str, cache: str, shared: bool,
               kernel_choice: str, out: str) -> None:
    torch.save(_worker_logits(model_dir, cache, rank, world, shared, kernel_choice),
               f"{out}.{rank}")


def test_tensor_parallel_ranks_run_the_layers_a_part_at_a_time(tiny_model_dir, tmp_path):
    """With tp=2 each rank's decode steps run the C++ layers a part (a layer's attention, its
    MLP) per call, the sum over the ranks between, through shared memory or gloo: every step's
    logits those of the ranks' eager layers with torch's products (kernel_choice="fixed"), and
    of the same run through gloo, to float32 rounding (not bitwise: each run times its other
    kernels, the prompt's attention among them, and under load may pick others). Not against
    one rank: int8's per-channel scales of a row-parallel weight are each rank's."""
    from tests.process_group import run_in_group

    path, runs = str(tiny_model_dir("llama")), {}
    parts = "quantized-decode-layers: a C++ call per layer part, all-reduced between"
    for shared, choice, said in (
            (True, "fixed", ("shared memory (CPU tensors; gloo otherwise)", [
                "quantized-decode-layers: off (the C++ row products were not timed for every "
                "projection (kernel_choice='fixed'))"])),
            (True, "measure", ("shared memory (CPU tensors; gloo otherwise)", [parts])),
            (False, "measure", ("gloo", [parts]))):
        out = tmp_path / f"{shared}-{choice}"
        run_in_group(2, _tp2_ranks, path, str(fresh_cache(tmp_path / "cache")), shared, choice,
                     str(out))
        runs[shared, choice], said_by_0 = torch.load(f"{out}.0")
        assert torch.load(f"{out}.1")[1] == said_by_0 == said
    for other in (runs[True, "fixed"], runs[False, "measure"]):
        for step, (got, want) in enumerate(zip(runs[True, "measure"], other)):
            assert got is not None and want is not None
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"step {step}: {m}")


# a prompt step of three sequences, then two decode steps, each reading only the KV the steps
# before wrote (the start-up's timed decode steps leave theirs in the cache, which WORKER_STEPS'
# later steps would read)
FLOAT_STEPS = [(40, 0, 3), (1, 40, 3), (1, 41, 3)]


def _float_worker_run(rank: int, world: int, model_dir: str, cache: str, kernel_choice: str,
                      seconds: dict[int, dict[str, float]], unfit_rank: int | None,
                      compile: bool, out: str) -> None:
    """A float32 rank's Worker (eager, or `compile`) run through FLOAT_STEPS, its decode-step
    timing made to read `seconds[rank]` (each way still runs once, on every rank) and, on
    `unfit_rank`, its layers made unfit for the C++ call; saves (rank 0's logits and step
    graphs, its rank_info lines)."""
    from engine.config import EngineConfig
    from engine.loading.checkpoint import open_checkpoint
    from engine.plan import make_plan
    from engine.rank import kernel_choice as kc, worker as worker_module
    from tests.fake_cuda_run import make_batch

    mp = pytest.MonkeyPatch()
    mp.setenv("PREFILL_ENGINE_CACHE", cache)

    def time_step(kind, candidates, rounds):
        for run in candidates.values():
            run()
        return {way: seconds[rank][way] for way in candidates}  # a way misnamed: KeyError

    mp.setattr(kc, "_time_step", time_step)
    if rank == unfit_rank:
        mp.setattr(worker_module, "float_unfit_reason", lambda model, heads: "made unfit")
    cfg = EngineConfig.from_kwargs(model=model_dir, tp=world, block_size=16, max_model_len=256,
                                   compile=compile, kernel_choice=kernel_choice)
    ckpt = open_checkpoint(model_dir)
    worker = worker_module.Worker(make_plan(cfg, model_dir, ckpt.config), rank=rank,
                                  world_size=world, checkpoint=ckpt)
    steps = []
    for shape in FLOAT_STEPS:
        batch = make_batch(*shape)
        batch.return_logits = True
        result = worker.execute(batch)  # rank 0's; None on the others
        steps.append(None if result is None else (result.logits, result.graph))
    lines = [k for k in worker.info().kernels if k.startswith(("decode-steps", "float-decode"))]
    torch.save((steps, lines), f"{out}.{rank}")


def _float_ranks(tmp_path, name: str, model_dir: str, world: int, kernel_choice: str = "measure",
                 seconds: dict[int, dict[str, float]] | None = None,
                 unfit_rank: int | None = None, compile: bool = False,
                 kept_step_timing: bool = False) -> tuple[list, list[list[str]]]:
    """`world` float32 ranks in a gloo group run so: (rank 0's steps, each rank's lines). Every
    run of the session shares one cache folder: the kernels' timings (the same model and
    shapes each time, none of them stood in) are taken once, not at each of these starts; the
    decode-step timing these tests stand in (kept by one rank) is dropped before each run
    unless `kept_step_timing`."""
    from engine.machine import read_whole, write_whole
    from tests.process_group import run_in_group

    out, timings = str(tmp_path / name), _float_ranks_cache(tmp_path) / "kernel_timings.json"
    if not kept_step_timing:
        write_whole(timings, {key: entry for key, entry in read_whole(timings).items()
                              if "|decode-steps|" not in key})
    run_in_group(world, _float_worker_run, model_dir, str(timings.parent),
                 kernel_choice, seconds or {}, unfit_rank, compile, out)
    runs = [torch.load(f"{out}.{rank}") for rank in range(world)]
    return runs[0][0], [lines for _, lines in runs]


def _float_ranks_cache(tmp_path):
    return fresh_cache(tmp_path.parent / "float-ranks-cache")


@pytest.fixture(scope="module")
def float_ranks_eager(tiny_model_dir, tmp_path_factory):
    """world -> rank 0's steps of that many eager float32 ranks (kernel_choice="fixed": no
    timing), which say nothing of the C++ call."""
    kept = {}

    def steps(world: int) -> list:
        if world not in kept:
            kept[world], lines = _float_ranks(tmp_path_factory.mktemp("eager"), "fixed",
                                              str(tiny_model_dir("llama")), world, "fixed")
            assert lines == [[]] * world
        return kept[world]

    return steps


@pytest.mark.parametrize("world", [1, 2])
def test_eager_float_ranks_decode_the_way_rank_0_timed_fastest(tiny_model_dir, float_ranks_eager,
                                                               world, tmp_path):
    """An eager float32 engine (one rank, or two) times a decode step after start-up as the
    C++ layers (one call; tp=2: a call per layer part) and eagerly; every rank takes rank 0's
    pick, at tp=2 even where rank 1 timed the other way faster (ranks choosing apart would sum
    differently made steps); decode steps so picked run the call ("layers-call") and give the
    eager ranks' logits (kernel_choice="fixed": no timing) to float32 rounding; prompts stay
    eager. One rank keeps its timing on disk and its next start reads it back (nothing timed);
    ranks of tp=2 time at every start (a kept timing on one rank only would part them)."""
    path, want = str(tiny_model_dir("llama")), float_ranks_eager(world)
    call = "one-call" if world == 1 else "part-calls"
    call_faster = {0: {"eager": 2e-3, call: 1e-3}, 1: {"eager": 1e-3, call: 2e-3}}
    eager_faster = {0: call_faster[1], 1: call_faster[0]}
    for seconds, said, graph in ((call_faster, f"{call} (eager 2 ms, {call} 1 ms)", "layers-call"),
                                 (eager_faster, f"eager (eager 1 ms, {call} 2 ms)", "")):
        steps, lines = _float_ranks(tmp_path, graph or "eager", path, world, seconds=seconds)
        assert lines == [lines[0]] * world and len(lines[0]) == 1
        assert lines[0][0].startswith("decode-steps ")
        assert lines[0][0].endswith(f" at 1 rows: {said}")
        assert [g for _, g in steps] == [""] + [graph] * (len(steps) - 1)
        for step, ((got, _), (expected, _)) in enumerate(zip(steps, want)):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"step {step}: {m}")
    from engine.machine import read_whole
    kept = read_whole(_float_ranks_cache(tmp_path) / "kernel_timings.json")
    assert len([key for key in kept if "|decode-steps|" in key]) == (world == 1)
    if world == 1:  # timed faster as the call now, but the kept timing decides
        _, lines = _float_ranks(tmp_path, "kept", path, 1, seconds=call_faster,
                                kept_step_timing=True)
        assert lines[0][0].endswith(" at 1 rows: eager (eager 1 ms, one-call 2 ms, kept on disk)")


def test_a_rank_whose_layers_cannot_take_the_call_keeps_every_rank_off_it(tiny_model_dir,
                                                                          float_ranks_eager,
                                                                          tmp_path):
    """tp=2, float32, rank 1's layers unfit for the C++ call: neither rank offers it (rank 0
    says another rank cannot run it, rank 1 its own reason), no decode step is timed or runs
    it, and the steps' logits are the eager ranks'."""
    path, want = str(tiny_model_dir("llama")), float_ranks_eager(2)
    seconds = {0: {"eager": 2e-3, "part-calls": 1e-3}, 1: {"eager": 2e-3, "part-calls": 1e-3}}
    steps, lines = _float_ranks(tmp_path, "unfit", path, 2, seconds=seconds, unfit_rank=1)
    assert lines == [["float-decode-layers: off (another rank of the group cannot run them)"],
                     ["float-decode-layers: off (made unfit)"]]
    assert {g for _, g in steps} == {""}
    for (got, _), (expected, _) in zip(steps, want):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_compiled_tensor_parallel_ranks_time_the_part_calls_against_their_graphs(
        tiny_model_dir, float_ranks_eager, tmp_path):
    """tp=2, float32, compile=True: the ranks' decode steps ran their graphs, so the part calls
    are timed against those ("graph"); where rank 0 timed the graphs faster, both ranks keep
    them (decode steps run a "decode-N" graph) and the logits are the eager ranks'."""
    path, want = str(tiny_model_dir("llama")), float_ranks_eager(2)
    seconds = {0: {"graph": 1e-3, "part-calls": 2e-3}, 1: {"graph": 2e-3, "part-calls": 1e-3}}
    steps, lines = _float_ranks(tmp_path, "graphs", path, 2, seconds=seconds, compile=True)
    assert lines == [[lines[0][0]]] * 2
    assert lines[0][0].endswith(" at 1 rows: graph (graph 1 ms, part-calls 2 ms)")
    assert all(g.startswith("decode-") for _, g in steps[1:]), [g for _, g in steps]
    for (got, _), (expected, _) in zip(steps, want):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
