"""engine.rank.int8_rows, the C++ product of a few rows with an int8 per-channel weight, against
a float64 formula (x times codes times scales); its refusals; its timing against torch's kernel
(engine.rank.kernel_choice); and an engine (weights="int8") where it wins, whose decode steps run
it for every projection and the LM head, eagerly and in the compiled decode graph, with the
tokens of torch's kernel."""
from __future__ import annotations

import pytest
import torch

from engine.rank import int8_rows as ir
from engine.rank import kernel_choice as kc
from engine.rank.quantized import int4_groups, int8_per_channel

# float32: its rounding over sums of up to 1536 products; bf16: the output's rounding (2^-8
# relative) of values up to ~60
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.5}


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(tmp_path_factory.getbasetemp() / "int8"))


def _weight(n: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return int8_per_channel(torch.randn(n, k, generator=gen).to(dtype))


def _float64(x: torch.Tensor, weight) -> torch.Tensor:
    return x.double() @ (weight.codes.double() * weight.scales.double()[:, None]).t()


def test_it_builds_here():
    assert ir.available()


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(37, 16), (300, 576), (64, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ir.DTYPES)
def test_matches_float64(rows, n, k, threads, dtype):
    """Odd output counts, one vector of inputs and many, every row count it takes; x as strided
    rows of a wider buffer (a view, as a graph may pass)."""
    weight = _weight(n, k, dtype, seed=n + k)
    wide = torch.randn(rows, k + 16, generator=torch.Generator().manual_seed(rows)).to(dtype)
    x = wide[:, 8:8 + k]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = ir.product(x, weight.codes, weight.scales)
    finally:
        torch.set_num_threads(before)
    assert y.shape == (rows, n) and y.dtype == dtype
    torch.testing.assert_close(y.double(), _float64(x, weight), atol=TOLERANCE[dtype],
                               rtol=2 ** -8 if dtype == torch.bfloat16 else 0)


def test_bias_and_leading_dims():
    weight = _weight(48, 32, torch.float32, seed=1)
    x, bias = torch.randn(1, 2, 32), torch.randn(48)
    y = ir.linear(x, weight, bias)
    assert y.shape == (1, 2, 48)
    torch.testing.assert_close(y.double(), _float64(x.view(2, 32), weight).view(1, 2, 48) + bias,
                               atol=1e-4, rtol=0)


def test_row_counts_it_does_not_take_are_refused():
    weight = _weight(16, 32, torch.float32, seed=2)
    with pytest.raises(ValueError, match="1-4 rows of a multiple of 16"):
        ir.product(torch.randn(5, 32), weight.codes, weight.scales)


def test_no_rows_and_other_dtypes():
    """No rows: an empty product; x of another dtype or strided along k: converted, and the
    answer comes in the scales' dtype."""
    weight = _weight(16, 32, torch.bfloat16, seed=2)
    assert ir.product(torch.randn(0, 32), weight.codes, weight.scales).shape == (0, 16)
    x = torch.randn(32, 2)[:, 0].unsqueeze(0)  # float32, k-stride 2
    y = ir.product(x, weight.codes, weight.scales)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), _float64(x.bfloat16(), weight), atol=0.1, rtol=2 ** -8)


def test_weights_it_does_not_take():
    assert ir.takes(_weight(16, 32, torch.float32, seed=3))
    assert not ir.takes(_weight(16, 40, torch.float32, seed=3))  # inputs not whole vectors
    assert not ir.takes(_weight(16, 32, torch.float16, seed=3))
    assert not ir.takes(int4_groups(torch.randn(16, 32)))


def test_int8_shapes_are_timed_against_torch_and_kept(tmp_path, monkeypatch):
    """Each int8 shape once (two weights of one shape: one timing), int4 weights never; the
    timing is read back from disk by the next choice."""
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(tmp_path))
    weights = [_weight(64, 32, torch.float32, 4), _weight(64, 32, torch.float32, 5),
               _weight(32, 64, torch.float32, 6), int4_groups(torch.randn(32, 64))]
    choice = kc.KernelChoice(torch.float32)
    choice.choose_int8_rows(weights)
    assert [(p.op, p.shape, p.rows) for p in choice.picks] == [("int8-rows", (64, 32), 1),
                                                               ("int8-rows", (32, 64), 1)]
    for pick in choice.picks:
        assert set(pick.seconds) == {"torch", "fused"} and min(pick.seconds.values()) > 0
        assert (pick.shape in choice.int8_rows_shapes) == (pick.kernel == "fused")
    again = kc.KernelChoice(torch.float32)
    again.choose_int8_rows(weights)
    assert all(p.from_disk for p in again.picks)
    assert [p.seconds for p in again.picks] == [p.seconds for p in choice.picks]


def test_a_machine_without_it_keeps_torchs_kernel(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(ir.LIBRARY, "_loaded", [])
    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    choice = kc.KernelChoice(torch.float32)
    choice.choose_int8_rows([_weight(64, 32, torch.float32, 4)])
    assert choice.picks == [] and not choice.int8_rows_shapes
    assert "int8 row product is unavailable here" in caplog.text


@pytest.mark.parametrize("compile", [False, True])
def test_an_engine_where_it_wins_runs_it_and_keeps_the_tokens(tiny_model_dir, monkeypatch,
                                                              tmp_path, compile):
    """weights="int8", the kernel made to win every shape: each decode step runs it for every
    projection of every layer and the LM head (so do the prompt's last o_proj and MLP and its LM
    head, on its one sampling row), and the greedy tokens are torch's kernel's."""
    import json

    from engine import LLM, SamplingParams

    monkeypatch.setenv("PREFILL_ENGINE_CACHE", str(tmp_path))
    timed = kc._time_linear
    monkeypatch.setattr(kc, "_time_linear", lambda kernels, weight, rows, prepare=None: (
        {"torch": 3e-3, "fused": 1e-3} if set(kernels) == {"torch", "fused"}
        else timed(kernels, weight, rows, prepare)))
    library, calls = ir.LIBRARY.get(), []

    class Counted:
        def int8_rows_product(self, *args):
            calls.append(args[6])  # the output width
            return library.int8_rows_product(*args)

    monkeypatch.setattr(ir.LIBRARY, "get", Counted)
    path = tiny_model_dir("llama")
    config = json.loads((path / "config.json").read_text())
    prompt = [(7 * i) % 200 + 3 for i in range(20)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    tokens = {}
    for choice in ("fixed", "measure"):
        with LLM(str(path), weights="int8", kernel_choice=choice, compile=compile,
                 enable_prefix_caching=False) as llm:
            calls.clear()
            tokens[choice] = list(llm.generate([prompt], params)[0].token_ids)
            if choice == "fixed":
                assert calls == []
            else:
                [info] = llm.rank_info()
    assert sum(line.startswith("int8-rows") and ": fused (" in line for line in info.kernels) == 5
    hidden, heads, kv_heads = (config[k] for k in ("hidden_size", "num_attention_heads",
                                                   "num_key_value_heads"))
    head_dim = hidden // heads
    layer = [(heads + 2 * kv_heads) * head_dim, hidden, 2 * config["intermediate_size"], hidden]
    step = layer * config["num_hidden_layers"] + [config["vocab_size"]]
    # the prompt's last o_proj and MLP and the LM head (its one sampling row), then the 3
    # decode steps
    assert calls == layer[1:] + [config["vocab_size"]] + step * 3
    assert tokens["measure"] == tokens["fixed"]
