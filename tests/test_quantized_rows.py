"""engine.rank.quantized_rows, the C++ products of a few rows with quantized weights: int8 per
channel against a float64 formula (x times codes times scales); int4 in GGUF's Q4 blocks against
float64 products with the blocks' own values (d q + m), within the int16 rounding of x the
kernel states; builds for an AVX2 CPU without VNNI and for one without AVX2; their refusals; their
timing against torch's kernels (engine.rank.kernel_choice); and engines (weights="int8", "int4")
where they win, whose decode steps run them for every projection (inside one call for every
layer, engine.rank.quantized_layers) and the int8 LM head, with compile on or off, and keep the
tokens of torch's kernels."""
from __future__ import annotations

import pytest
import torch

from engine.rank import quantized_rows as qr
from tests.cpu_features import run_in_a_build_for
from tests.op_calls import op_calls
from tests.row_timings import certain_row_timings
from engine.rank import kernel_choice as kc
from engine.loading.gguf_blocks import Q4Blocks
from engine.rank.quantized import from_q4_blocks, int4_groups, int8_per_channel
from tests.engine_cache import fresh_cache

# float32: its rounding over sums of up to 1536 products; bf16: the output's rounding (2^-8
# relative) of values up to ~60
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.5}


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PREFILL_ENGINE_CACHE",
                       str(fresh_cache(tmp_path_factory.getbasetemp() / "int8")))


def _weight(n: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return int8_per_channel(torch.randn(n, k, generator=gen).to(dtype))


def _float64(x: torch.Tensor, weight) -> torch.Tensor:
    return x.double() @ (weight.codes.double() * weight.scales.double()[:, None]).t()


def test_it_builds_here():
    assert qr.available()


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(37, 16), (300, 576), (64, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", qr.DTYPES)
def test_matches_float64(rows, n, k, threads, dtype):
    """Odd output counts, one vector of inputs and many, every row count it takes; x as strided
    rows of a wider buffer (a view, as a graph may pass)."""
    weight = _weight(n, k, dtype, seed=n + k)
    wide = torch.randn(rows, k + 16, generator=torch.Generator().manual_seed(rows)).to(dtype)
    x = wide[:, 8:8 + k]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = qr.int8_product(x, weight.codes, weight.scales)
    finally:
        torch.set_num_threads(before)
    assert y.shape == (rows, n) and y.dtype == dtype
    torch.testing.assert_close(y.double(), _float64(x, weight), atol=TOLERANCE[dtype],
                               rtol=2 ** -8 if dtype == torch.bfloat16 else 0)


def test_bias_and_leading_dims():
    weight = _weight(48, 32, torch.float32, seed=1)
    x, bias = torch.randn(1, 2, 32), torch.randn(48)
    y = qr.linear(x, weight, bias)
    assert y.shape == (1, 2, 48)
    torch.testing.assert_close(y.double(), _float64(x.view(2, 32), weight).view(1, 2, 48) + bias,
                               atol=1e-4, rtol=0)


def test_row_counts_it_does_not_take_are_refused():
    weight = _weight(16, 32, torch.float32, seed=2)
    with pytest.raises(ValueError, match="1-4 rows of a multiple of 16"):
        qr.int8_product(torch.randn(5, 32), weight.codes, weight.scales)


def test_no_rows_and_other_dtypes():
    """No rows: an empty product; x of another dtype or strided along k: converted, and the
    answer comes in the scales' dtype."""
    weight = _weight(16, 32, torch.bfloat16, seed=2)
    assert qr.int8_product(torch.randn(0, 32), weight.codes, weight.scales).shape == (0, 16)
    x = torch.randn(32, 2)[:, 0].unsqueeze(0)  # float32, k-stride 2
    y = qr.int8_product(x, weight.codes, weight.scales)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), _float64(x.bfloat16(), weight), atol=0.1, rtol=2 ** -8)


def test_weights_it_does_not_take():
    assert qr.takes(_weight(16, 32, torch.float32, seed=3))
    assert not qr.takes(_weight(16, 40, torch.float32, seed=3))  # inputs not whole vectors
    assert not qr.takes(_weight(16, 32, torch.float16, seed=3))
    assert qr.takes(int4_groups(torch.randn(16, 32)))
    assert not qr.takes(int4_groups(torch.randn(16, 32).half()))


def _q4_weight(n: int, k: int, dtype: torch.dtype, seed: int):
    """Random Q4 blocks (codes 0..15, scales and minimums of both signs) as the engine holds
    them, and their values in float64 from the blocks themselves (d and m as stored in dtype)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d = torch.rand(n, k // 32, generator=gen) * 0.2
    m = torch.randn(n, k // 32, generator=gen) * 0.5
    weight = from_q4_blocks(Q4Blocks(codes, d, m), dtype)
    values = (codes.double().view(n, k // 32, 32) * d.to(dtype).double()[..., None]
              + m.to(dtype).double()[..., None]).view(n, k)
    return weight, values


def _q4_bound(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The kernel's stated error for each output: x rounded to int16 per group of 32, at most
    half a step max|x| / 32767 per input, times |w| summed; plus float32 sums' rounding."""
    rows, k = x.shape
    step = x.double().abs().view(rows, k // 32, 32).amax(-1) / 32767
    rounding = (step / 2).repeat_interleave(32, dim=1)
    return rounding @ values.abs().t() + 1e-5 * (x.double().abs() @ values.abs().t())


def _check_q4(product, rows: int, n: int, k: int, dtype: torch.dtype, seed: int) -> None:
    weight, values = _q4_weight(n, k, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    wide = torch.randn(rows, k + 32, generator=gen) * torch.rand(rows, k + 32, generator=gen) * 8
    x = wide.to(dtype)[:, 16:16 + k]  # strided rows of a wider buffer, values of mixed sizes
    y = product(x, weight.nibbles, weight.steps)
    assert y.shape == (rows, n) and y.dtype == dtype
    want = x.double() @ values.t()
    error = (y.double() - want).abs()
    output_rounding = 2 ** -8 * want.abs() if dtype == torch.bfloat16 else 0
    assert (error <= _q4_bound(x, values) + output_rounding).all(), error.max()


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (304, 576), (64, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", qr.DTYPES)
def test_q4_matches_float64_within_its_rounding(rows, n, k, threads, dtype):
    """One group, an odd count of groups (the unrolled loop's last), 18 and 48 groups (whole
    vectors of group scales and a rest); every row count it takes."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_q4(qr.q4_product, rows, n, k, dtype, seed=rows + n + k)
    finally:
        torch.set_num_threads(before)


def test_q4_rounding_is_what_it_states_and_no_more():
    """The bound is tight enough to catch a kernel that rounds x coarser: int8 rounding (what
    llama.cpp's Q4 products do) breaks it on these values; a group of zeros gives zeros."""
    weight, values = _q4_weight(64, 576, torch.float32, seed=9)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(3))
    x[0, 32:64] = 0
    steps = x.abs().view(1, 18, 32).amax(-1, keepdim=True) / 127
    as_int8 = (torch.round(x.view(1, 18, 32) / steps.clamp(min=1e-30)) * steps).view(1, 576)
    coarse = (as_int8.double() @ values.t() - x.double() @ values.t()).abs()
    assert (coarse > _q4_bound(x, values)).any()
    y = qr.q4_product(x, weight.nibbles, weight.steps)
    assert ((y.double() - x.double() @ values.t()).abs() <= _q4_bound(x, values)).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_q4_a_non_finite_input_gives_non_finite_outputs(bad):
    """As a float product's would be: never a finite number that hides it (the kernel's
    rounding divides by the group's largest value)."""
    weight, values = _q4_weight(32, 96, torch.float32, seed=4)
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(5))
    x[1, 40] = bad  # the second group of the second row
    y = qr.q4_product(x, weight.nibbles, weight.steps)
    assert torch.isfinite(y[0]).all() and not torch.isfinite(y[1]).any()
    assert ((y[0].double() - x[0].double() @ values.t()).abs()
            <= _q4_bound(x[:1], values)[0]).all()


def test_q4_groups_of_tiny_values_stay_close():
    """Groups whose largest value is ~1e-36 (32767 / it overflows float32; its step lies
    below float32's normal range) or subnormal (~1e-42): at most ~1e-38 off, float32's own
    underflow, never the saturated codes an overflowed rounding would give (~1e-36 off)."""
    weight, values = _q4_weight(16, 96, torch.float32, seed=6)
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(7))
    x[0, :32] *= 1e-36
    y = qr.q4_product(x[:, :32].contiguous(), *_first_group(weight))
    want = x[:, :32].double() @ values[:, :32].t()
    assert ((y.double() - want).abs() <= _q4_bound(x[:, :32], values[:, :32]) + 1e-38).all()
    assert (y.double() - want).abs().max() < 1e-3 * want.abs().max()
    x[0, 32:64] *= 1e-42  # subnormal
    y = qr.q4_product(x, weight.nibbles, weight.steps)
    want = x.double() @ values.t()
    assert ((y.double() - want).abs() <= _q4_bound(x, values) + 1e-38).all()


def _first_group(weight):
    """The nibbles and steps of a Q4 weight's first 32 inputs only."""
    n, k = weight.shape
    return (weight.nibbles[:, :16].contiguous(), weight.steps[:, :, :1].contiguous())


def test_q4_built_for_avx2_without_vnni(tmp_path):
    """The AVX2 CPUs' code (vpmaddwd, no vpdpwssd), within the same bound."""
    out = run_in_a_build_for("x86-64-v3", tmp_path, (
        "import torch\n"
        "from engine.rank import quantized_rows as qr\n"
        "from tests.test_quantized_rows import _check_q4\n"
        "assert qr.available('int4')\n"
        "for dtype in qr.DTYPES:\n"
        "    _check_q4(qr.q4_product, 3, 48, 576, dtype, seed=5)\n"
        "print('checked')\n"))
    assert out.split() == ["checked"]


def test_q4_on_a_cpu_without_avx2_is_not_offered(tmp_path):
    """int8 still runs there; int4's op says why it does not, and is never timed."""
    out = run_in_a_build_for("x86-64", tmp_path, (
        "import torch\n"
        "from engine.rank import kernel_choice as kc, quantized_rows as qr\n"
        "from tests.test_quantized_rows import _q4_weight\n"
        "assert qr.available('int8') and not qr.available('int4')\n"
        "weight, _ = _q4_weight(16, 32, torch.float32, seed=1)\n"
        "try:\n"
        "    qr.q4_product(torch.randn(1, 32), weight.nibbles, weight.steps)\n"
        "except NotImplementedError as e:\n"
        "    print('refused:', 'needs AVX2' in str(e))\n"
        "choice = kc.KernelChoice(torch.float32)\n"
        "choice.choose_quantized_rows([weight])\n"
        "print('timed:', len(choice.picks))\n"))
    assert out.splitlines() == ["refused: True", "timed: 0"]


def test_q4_refusals():
    weight, _ = _q4_weight(16, 64, torch.float32, seed=2)
    with pytest.raises(ValueError, match="1-4 rows of a multiple of 32"):
        qr.q4_product(torch.randn(5, 64), weight.nibbles, weight.steps)
    assert qr.q4_product(torch.randn(0, 64), weight.nibbles, weight.steps).shape == (0, 16)


def test_int8_shapes_are_timed_against_torch_and_kept(tmp_path, monkeypatch):
    """Each shape of each kind once (two weights of one shape: one timing; an int4 weight of an
    int8 one's shape: a timing of its own); the timing is read back from disk by the next
    choice."""
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(fresh_cache(tmp_path)))
    weights = [_weight(64, 32, torch.float32, 4), _weight(64, 32, torch.float32, 5),
               _weight(32, 64, torch.float32, 6), int4_groups(torch.randn(32, 64))]
    choice = kc.KernelChoice(torch.float32)
    choice.choose_quantized_rows(weights)
    assert [(p.op, p.shape, p.rows) for p in choice.picks] == [("int8-rows", (64, 32), 1),
                                                               ("int8-rows", (32, 64), 1),
                                                               ("int4-rows", (32, 64), 1)]
    for pick in choice.picks:
        assert set(pick.seconds) == {"torch", "fused"} and min(pick.seconds.values()) > 0
        kind = pick.op.split("-")[0]
        assert ((kind, pick.shape) in choice.quantized_rows_shapes) == (pick.kernel == "fused")
    again = kc.KernelChoice(torch.float32)
    again.choose_quantized_rows(weights)
    assert all(p.from_disk for p in again.picks)
    assert [p.seconds for p in again.picks] == [p.seconds for p in choice.picks]


def test_a_machine_without_it_keeps_torchs_kernel(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(qr.LIBRARY, "_loaded", [])
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    choice = kc.KernelChoice(torch.float32)
    choice.choose_quantized_rows([_weight(64, 32, torch.float32, 4)])
    assert choice.picks == [] and not choice.quantized_rows_shapes
    assert "quantized row product is unavailable here" in caplog.text


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_an_engine_where_they_win_runs_them_and_keeps_the_tokens(tiny_model_dir, monkeypatch,
                                                                 tmp_path, compile, weights):
    """The kernels made to win every shape: each decode step runs its layers in one call
    (engine.rank.quantized_layers: the products with int8 or int4 codes inside) and the int8
    LM head; the prompt's last o_proj and MLP and its LM head, on its one sampling row, run the
    row products; and the greedy tokens are torch's kernels'."""
    import json

    from engine import LLM, SamplingParams

    certain_row_timings(monkeypatch, tmp_path)
    names = {"prefill::int8_rows": "int8", "prefill::q4_rows": "int4",
             "prefill::quantized_decode_layers": "layers"}
    path = tiny_model_dir("llama")
    config = json.loads((path / "config.json").read_text())
    prompt = [(7 * i) % 200 + 3 for i in range(20)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    tokens = {}
    for choice in ("fixed", "measure"):
        with LLM(str(path), weights=weights, kernel_choice=choice, compile=compile,
                 enable_prefix_caching=False) as llm:
            outputs, called = op_calls(llm, lambda: llm.generate([prompt], params), set(names))
            tokens[choice] = list(outputs[0].token_ids)
            # (kind, outputs) of a row product (its codes are its second input); ("layers",
            # layers) of the layers' call (its KV cache, the tenth input, has every layer's)
            calls = [("layers", shapes[9][1]) if name.endswith("layers")
                     else (names[name], shapes[1][0]) for name, shapes in called]
            if choice == "fixed":
                assert calls == []
                assert any(line.startswith("quantized-decode-layers: off (the C++ row products")
                           for line in llm.rank_info()[0].kernels)
            else:
                [info] = llm.rank_info()
    fused = [line.split(" ", 1)[0] for line in info.kernels
             if line.split(" ", 1)[0].endswith("-rows") and ": fused (" in line]
    assert sorted(fused) == sorted([f"{weights}-rows"] * 4 + ["int8-rows"]), fused
    hidden, heads, kv_heads = (config[k] for k in ("hidden_size", "num_attention_heads",
                                                   "num_key_value_heads"))
    head_dim = hidden // heads
    layer = [(weights, n) for n in ((heads + 2 * kv_heads) * head_dim, hidden,
                                    2 * config["intermediate_size"], hidden)]
    head = [("int8", config["vocab_size"])]
    step = [("layers", config["num_hidden_layers"])] + head
    # the prompt's last o_proj and MLP and the LM head (its one sampling row), then the 3
    # decode steps
    assert calls == layer[1:] + head + step * 3
    assert tokens["measure"] == tokens["fixed"]
    assert "quantized-decode-layers: one C++ call a step" in info.kernels
