"""Sampler and SamplingParams, checked against hand-known distributions.

Every expectation here comes from a hand computation or a plain-torch formula
(argmax, topk, softmax), never from the sampler's own output.
"""
import math

import pytest
import torch

from engine.batch import SamplingSpec
from engine.errors import InvalidRequestError
from engine.rank.sampler import sample
from engine.driver.sampling_params import SamplingParams

# softmax(log(p)) == p, so these logits have probabilities known by hand
PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = torch.tensor(PROBS).log()


def _draw(logits_row, n, **spec_kwargs):
    """n draws of one row, each at its own step so the seeded generator differs per draw."""
    seed = spec_kwargs.pop("seed", 1234)
    rows = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    specs = [SamplingSpec(seed=seed, step=i, **spec_kwargs) for i in range(n)]
    return sample(rows, specs)


# ---------------------------------------------------------------- greedy


def test_greedy_picks_argmax_of_each_row():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9],
                           [5.0, 4.0, 3.0, 2.0],
                           [-9.0, -8.0, -7.0, -6.5]])
    # argmax by hand: 1, 0, 3
    assert sample(logits, [SamplingSpec(temperature=0.0)] * 3) == [1, 0, 3]


def test_greedy_ties_take_the_first_in_every_dtype():
    """A vocabulary-sized row whose largest value is shared, among infinities of the other
    sign: the first index, from a float32 row (numpy's argmax), a strided view of one, and a
    bf16 row (torch's)."""
    row = torch.full((49152,), float("-inf"))
    row[[40000, 300, 7000]] = 2.5
    row[[5, 60]] = 2.0
    for logits in (row[None], row.expand(3, -1), torch.stack([row, row])[:, ::1],
                   row[None].bfloat16()):
        assert sample(logits, [SamplingSpec(temperature=0.0)] * len(logits)) == [300] * len(logits)


def test_greedy_ignores_seed_top_k_top_p_and_step():
    logits = torch.tensor([[0.0, 1.0, 7.0, 2.0]])
    specs = [SamplingSpec(temperature=0.0, top_k=2, top_p=0.1, seed=s, step=s) for s in range(5)]
    assert sample(logits.expand(5, -1), specs) == [2] * 5


def test_rows_use_their_own_spec():
    # row 0 greedy -> 3; row 1 top_k=1 -> its own argmax 0, so rows are not mixed up
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    specs = [SamplingSpec(temperature=0.0), SamplingSpec(temperature=1.0, top_k=1, seed=7)]
    assert sample(logits, specs) == [3, 0]


# ---------------------------------------------------------------- top-k


def test_top_k_1_with_temperature_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    expected = logits.argmax(-1).tolist()
    for step in range(20):
        specs = [SamplingSpec(temperature=1.5, top_k=1, seed=step, step=step)] * 8
        assert sample(logits, specs) == expected


def test_top_k_never_samples_outside_the_k_largest():
    torch.manual_seed(1)
    logits = torch.randn(20) * 0.1  # nearly flat: without the filter every token would appear
    k = 3
    allowed = set(torch.topk(logits, k).indices.tolist())
    drawn = _draw(logits, 600, temperature=1.0, top_k=k)
    assert set(drawn) <= allowed
    assert set(drawn) == allowed  # 600 draws over 3 near-equal tokens reach all of them


def test_top_k_larger_than_vocab_is_no_filter():
    drawn = _draw(LOGITS, 800, temperature=1.0, top_k=100)
    assert set(drawn) == {0, 1, 2, 3}  # P(never seeing token 3 in 800) = 0.95**800 ~ 1e-18


# ---------------------------------------------------------------- top-p
# Sorted probabilities 0.5, 0.3, 0.15, 0.05; mass before each token: 0, 0.5, 0.8, 0.95.
# Nucleus = smallest set whose mass reaches top_p.


def test_top_p_half_keeps_only_the_top_token():
    assert set(_draw(LOGITS, 300, temperature=1.0, top_p=0.5)) == {0}


def test_top_p_point8_keeps_tokens_0_and_1():
    # 0.5 + 0.3 = 0.8 already reaches top_p, so token 2 is out (an exact tie: in float32 the
    # mass before token 2 comes out 0.80000007, so the boundary falls on the intended side)
    drawn = _draw(LOGITS, 300, temperature=1.0, top_p=0.8)
    assert set(drawn) == {0, 1}


def test_top_p_point81_adds_token_2():
    # 0.8 < 0.81, so token 2 is needed; 0.95 >= 0.81, so token 3 is out
    drawn = _draw(LOGITS, 400, temperature=1.0, top_p=0.81)  # P(no token 2) = 0.85**400
    assert set(drawn) == {0, 1, 2}


def test_top_p_one_keeps_everything():
    # P(token 3 never drawn in 800) = 0.95**800 ~ 1e-18
    assert set(_draw(LOGITS, 800, temperature=1.0, top_p=1.0)) == {0, 1, 2, 3}


def test_top_p_renormalises_the_kept_tokens():
    # kept {0, 1} with mass 0.8: P(0) = 0.5 / 0.8 = 0.625, P(1) = 0.375 (unfiltered P(0) = 0.5 is
    # 0.125 away, 10 SE at n = 1500)
    n = 1500
    drawn = _draw(LOGITS, n, temperature=1.0, top_p=0.8)
    freq0 = drawn.count(0) / n
    se = math.sqrt(0.625 * 0.375 / n)
    assert abs(freq0 - 0.625) < 4 * se


def test_top_p_works_on_unsorted_vocab():
    # same probabilities, shuffled positions: nucleus at 0.8 must be the tokens holding 0.5 and 0.3
    perm = [2, 0, 3, 1]  # new position i holds PROBS[perm[i]]
    logits = LOGITS[perm]
    drawn = _draw(logits, 400, temperature=1.0, top_p=0.8)
    assert set(drawn) == {perm.index(0), perm.index(1)}


# ---------------------------------------------------------------- temperature


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_frequencies_match_softmax_of_scaled_logits(temperature):
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    expected = torch.softmax(logits / temperature, -1).tolist()
    n = 2500
    drawn = _draw(logits, n, temperature=temperature, seed=99)
    for tok, p in enumerate(expected):
        freq = drawn.count(tok) / n
        # binomial standard error (<= 0.01 at n = 2500); 4 SE is a false alarm rate of ~6e-5 per
        # token for a correct sampler, while the untempered softmax is >= 0.11 off on token 0
        se = math.sqrt(p * (1 - p) / n)
        assert abs(freq - p) < 4 * se, (tok, freq, p)
    # the check can fail: the temperature-1 distribution lies outside the tolerance for token 0
    plain = torch.softmax(logits, -1)[0].item()
    assert abs(plain - expected[0]) > 4 * math.sqrt(expected[0] * (1 - expected[0]) / n)


# ---------------------------------------------------------------- seeds


def test_same_seed_and_step_give_the_same_token():
    logits = torch.zeros(1, 1000)  # uniform: any difference in the generator shows
    for step in range(10):
        spec = SamplingSpec(temperature=1.0, seed=42, step=step)
        first = sample(logits, [spec])
        torch.manual_seed(step)  # the global generator must not matter for a seeded request
        assert sample(logits, [spec]) == first


def test_seeded_draw_does_not_depend_on_batch_position():
    logits = torch.zeros(3, 1000)
    spec = SamplingSpec(temperature=1.0, seed=5, step=3)
    alone = sample(logits[:1], [spec])[0]
    other = SamplingSpec(temperature=1.0, seed=6, step=0)
    assert sample(logits, [other, spec, other])[1] == alone


def test_different_steps_vary():
    logits = torch.zeros(1000)
    drawn = _draw(logits, 20, temperature=1.0, seed=42)
    # 20 uniform draws over 1000 tokens: all equal has probability 1000**-19
    assert len(set(drawn)) > 10


def test_different_seeds_vary():
    logits = torch.zeros(1, 1000)
    drawn = [sample(logits, [SamplingSpec(temperature=1.0, seed=s, step=0)])[0] for s in range(20)]
    assert len(set(drawn)) > 10


def test_unseeded_sampling_works_and_stays_in_range():
    logits = torch.zeros(4, 7)
    out = sample(logits, [SamplingSpec(temperature=1.0, seed=None)] * 4)
    assert len(out) == 4 and all(isinstance(t, int) and 0 <= t < 7 for t in out)


def test_params_spec_carries_fields_and_step():
    p = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3)
    s = p.spec(4)
    assert (s.temperature, s.top_k, s.top_p, s.seed, s.step) == (0.7, 5, 0.9, 3, 4)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -1}, "top_k"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kwargs)


GREEDY = [1.0, 0.0, 0.0, 0.0]  # LOGITS' argmax is token 0
UNIFORM = [0.25] * 4  # softmax(log(p) / 1e6) is within 1e-6 of uniform


@pytest.mark.parametrize("kwargs, expected", [
    ({"max_tokens": 1}, GREEDY), ({"max_tokens": 10**6}, GREEDY),  # temperature 0 by default
    ({"temperature": 0.0}, GREEDY),
    ({"temperature": 1e-4}, GREEDY),  # logit gaps >= 0.51 / 1e-4: exp(-5100) is 0 in float32
    ({"temperature": 1}, PROBS), ({"temperature": 1e6}, UNIFORM),
    ({"temperature": 1.0, "top_p": 1.0}, PROBS), ({"temperature": 1.0, "top_p": 1}, PROBS),
    ({"temperature": 1.0, "top_p": 1e-6}, GREEDY),  # the top token alone already covers 1e-6
    ({"temperature": 1.0, "top_k": 0}, PROBS),  # 0: no top-k filter
    ({"temperature": 1.0, "seed": 0}, PROBS), ({"temperature": 1.0, "seed": 2**200}, PROBS),
    ({"temperature": 1.0, "seed": 1_790_000_000_000_000_123}, PROBS),  # a time.time_ns() seed
])
def test_boundary_values_are_accepted_and_sample_their_distribution(kwargs, expected):
    """Each value at the edge of what SamplingParams accepts is kept as given and draws tokens with
    the frequencies worked out by hand for LOGITS (probabilities 0.5, 0.3, 0.15, 0.05)."""
    params = SamplingParams(**kwargs)
    assert all(getattr(params, k) == v for k, v in kwargs.items())
    n = 1000
    drawn = sample(LOGITS.expand(n, -1).contiguous(), [params.spec(step) for step in range(n)])
    for tok, p in enumerate(expected):
        # 4 binomial standard errors (a false alarm rate of ~6e-5 per token); exact for p = 0 or 1
        assert abs(drawn.count(tok) / n - p) <= 4 * math.sqrt(p * (1 - p) / n), (tok, drawn.count(tok), p)


def test_rows_with_any_nan_or_inf_are_flagged_and_sampled_safely():
    """A NaN or an infinity anywhere in a row (of a 49152-token vocabulary: the vectorised
    reduction's tail and body) flags that row, and only it; the others sample as they are."""
    from engine.batch import StepResult
    from engine.rank.sampler import Sampler, sample_into
    from engine.rank.warmup import warm_up_batch

    logits = torch.randn(5, 49152, generator=torch.Generator().manual_seed(0))
    logits[1, 100] = float("nan")
    logits[2, -1] = float("inf")
    logits[3, 0] = float("-inf")
    logits[4, 49151] = 1e38  # huge, finite
    batch = warm_up_batch(1, 0, 5, 16)
    result = StepResult([])
    sample_into(Sampler(), logits, batch, result)
    assert result.nonfinite_rows == [1, 2, 3]
    assert result.token_ids[0] == int(logits[0].argmax()) and result.token_ids[4] == 49151
