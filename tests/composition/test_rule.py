"""compose_logprobs: golden values, invariants, -inf handling and input errors."""

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergecompose.composition import check_composition, compose_logprobs, compose_logprobs_unchecked


def test_golden_values_two_experts():
    # p_b = (1/2, 1/4, 1/4), p_1 = (1/4, 1/2, 1/4), p_2 = (1/4, 1/4, 1/2).
    # p_b · (p_1/p_b) · (p_2/p_b) = p_1 p_2 / p_b = (1/8, 1/2, 1/2) -> normalised (1/9, 4/9, 4/9).
    base = torch.tensor([0.5, 0.25, 0.25]).log()
    expert_1 = torch.tensor([0.25, 0.5, 0.25]).log()
    expert_2 = torch.tensor([0.25, 0.25, 0.5]).log()
    composed = compose_logprobs(base, [expert_1, expert_2])
    torch.testing.assert_close(composed.exp(), torch.tensor([1 / 9, 4 / 9, 4 / 9]))


def test_golden_values_weighted_raw_logits():
    # Raw logits are normalised first. b = (0, 0), ℓ = (log 3, 0) -> p_1 = (3/4, 1/4).
    # w = 0.5: p_b^(1/2) p_1^(1/2) ∝ (sqrt(3/8), sqrt(1/8)) -> (sqrt 3, 1)/(sqrt 3 + 1).
    base = torch.tensor([[5.0, 5.0]])
    expert = torch.tensor([[math.log(3.0), 0.0]])
    composed = compose_logprobs(base, [expert], weights=[0.5])
    expected = torch.tensor([[math.sqrt(3), 1.0]]) / (math.sqrt(3) + 1)
    torch.testing.assert_close(composed.exp(), expected)


def test_single_expert_with_weight_one_is_that_expert():
    torch.manual_seed(0)
    base, expert = torch.randn(2, 3, 11), torch.randn(2, 3, 11)
    composed = compose_logprobs(base, [expert])
    torch.testing.assert_close(composed, torch.log_softmax(expert, -1))


def test_experts_equal_to_base_give_base():
    torch.manual_seed(1)
    base = torch.randn(4, 9)
    composed = compose_logprobs(base, [base.clone(), base + 3.0, base.clone()])
    torch.testing.assert_close(composed, torch.log_softmax(base, -1))


def test_float32_output_for_half_input():
    base = torch.randn(3, 8).to(torch.bfloat16)
    composed = compose_logprobs(base, [base.clone(), torch.randn(3, 8).half().to(torch.bfloat16)])
    assert composed.dtype == torch.float32


def test_per_position_weights_broadcast():
    torch.manual_seed(2)
    base, e1, e2 = torch.randn(3, 2, 5, 7).unbind(0)
    per_expert = torch.tensor([[1.0, 0.0, 1.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0, 0.0]])  # (k, T)
    weights = per_expert[:, None, :].expand(2, 2, 5)  # (k, B, T)
    composed = compose_logprobs(base, [e1, e2], weights=weights)
    # Position 3: both experts off -> the base. Position 0: expert 1 alone -> expert 1.
    torch.testing.assert_close(composed[:, 3], torch.log_softmax(base[:, 3], -1))
    torch.testing.assert_close(composed[:, 0], torch.log_softmax(e1[:, 0], -1))
    torch.testing.assert_close(composed[:, 2], compose_logprobs(base[:, 2], [e1[:, 2], e2[:, 2]]))


# ----------------------------------------------------------------------------- -inf handling


def test_token_ruled_out_by_an_expert_stays_impossible():
    base = torch.tensor([0.0, 0.0, 0.0])
    expert_1 = torch.tensor([0.0, -math.inf, 0.0])
    expert_2 = torch.tensor([0.0, 5.0, 0.0])
    composed = compose_logprobs(base, [expert_1, expert_2])
    assert composed[1] == -math.inf
    assert torch.isfinite(composed[[0, 2]]).all()
    torch.testing.assert_close(composed.exp().sum(), torch.tensor(1.0))


def test_token_ruled_out_by_base_with_positive_exponent_stays_impossible():
    # One expert at weight 0.5: the base's exponent is +0.5.
    base = torch.tensor([0.0, -math.inf, 0.0])
    expert = torch.tensor([0.0, 0.0, 0.0])
    composed = compose_logprobs(base, [expert], weights=[0.5])
    assert composed[1] == -math.inf


def test_token_ruled_out_by_base_but_allowed_by_experts_is_finite():
    # Two experts: the base's exponent is -1; its -inf is clamped to -1e4, so the token is
    # boosted by +1e4 and takes the mass, as the limit p_b -> 0 of the rule implies.
    base = torch.tensor([0.0, -math.inf, 0.0])
    expert_1 = torch.tensor([0.0, 0.0, 0.0])
    expert_2 = torch.tensor([1.0, 0.0, 0.0])
    composed = compose_logprobs(base, [expert_1, expert_2])
    assert torch.isfinite(composed).all()
    assert not torch.isnan(composed).any()
    assert composed.argmax() == 1
    torch.testing.assert_close(composed.exp().sum(), torch.tensor(1.0))


def test_single_expert_weight_one_ignores_base_minus_inf():
    base = torch.tensor([-math.inf, 0.0, 0.0])
    expert = torch.tensor([1.0, 2.0, -math.inf])
    composed = compose_logprobs(base, [expert])
    torch.testing.assert_close(composed, torch.log_softmax(expert, -1))


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "base, experts, weights, message",
    [
        (torch.zeros(2, 5), [torch.zeros(2, 6)], None, "vocabulary size mismatch"),
        (torch.zeros(2, 5), [torch.zeros(3, 5)], None, "shape mismatch"),
        (torch.zeros(2, 5), [], None, "at least one"),
        (torch.zeros(2, 5), [torch.zeros(2, 5)], [1.0, 1.0], "one weight per expert"),
        (torch.full((2, 5), math.nan), [torch.zeros(2, 5)], None, "`base` contains NaN"),
        (torch.zeros(2, 5), [torch.tensor([[0.0, math.nan, 0, 0, 0]] * 2)], None, r"`experts\[0\]` contains NaN"),
        (torch.zeros(5), [torch.tensor([-math.inf] * 5)], None, r"`experts\[0\]` rules out every token"),
        (torch.tensor([0.0, -math.inf]), [torch.tensor([-math.inf, 0.0])], [0.5], "every token is ruled out"),
    ],
)
def test_bad_input_raises(base, experts, weights, message):
    with pytest.raises(ValueError, match=message):
        compose_logprobs(base, experts, weights)


def test_check_composition_raises_what_compose_logprobs_raises_before_computing():
    with pytest.raises(ValueError, match=r"`experts\[0\]` contains NaN"):
        check_composition(torch.zeros(2, 5), [torch.tensor([[0.0, math.nan, 0, 0, 0]] * 2)])
    with pytest.raises(ValueError, match=r"`weights` must be finite, got inf at index \(1,\)"):
        check_composition(torch.zeros(2, 5), [torch.zeros(2, 5)] * 2, torch.tensor([1.0, math.inf]))
    check_composition(torch.zeros(2, 5), [torch.zeros(2, 5)], [0.5])  # valid: no error, nothing returned


def test_unchecked_rule_is_the_checked_rule_without_its_checks():
    torch.manual_seed(0)
    base, experts = torch.randn(3, 8), [torch.randn(3, 8), torch.randn(3, 8)]
    for weights in (None, [0.3, 1.2], torch.rand(2, 3)):
        assert torch.equal(compose_logprobs_unchecked(base, experts, weights), compose_logprobs(base, experts, weights))
    # Where every token is ruled out the checked rule raises; the unchecked one returns NaN there.
    ruled_out = compose_logprobs_unchecked(torch.tensor([0.0, -math.inf]), [torch.tensor([-math.inf, 0.0])], [0.5])
    assert torch.isnan(ruled_out).all()


def test_validate_is_a_deprecated_alias():
    base, expert = torch.tensor([[0.0, 1.0, 2.0]]), torch.tensor([[2.0, 1.0, 0.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning without `validate`
        plain = compose_logprobs(base, [expert])
    for validate in (True, False):
        with pytest.deprecated_call(match=r"`compose_logprobs\(..., validate=...\)` is deprecated"):
            assert torch.equal(compose_logprobs(base, [expert], validate=validate), plain)
    # validate=False skipped the checks of values, not those of the arguments.
    with pytest.deprecated_call():
        assert torch.isnan(compose_logprobs(base * math.nan, [expert], validate=False)).all()
    with pytest.deprecated_call(), pytest.raises(ValueError, match="shape mismatch"):
        compose_logprobs(base, [torch.zeros(2, 3)], validate=False)


# ----------------------------------------------------------------------------- properties

shapes = st.tuples(st.integers(1, 3), st.integers(2, 12))
finite = st.floats(-20, 20, allow_nan=False, width=32)


@st.composite
def components(draw):
    rows, vocab = draw(shapes)
    k = draw(st.integers(1, 4))
    values = draw(
        st.lists(st.lists(finite, min_size=rows * vocab, max_size=rows * vocab), min_size=k + 1, max_size=k + 1)
    )
    tensors = [torch.tensor(v).reshape(rows, vocab) for v in values]
    return tensors[0], tensors[1:]


@settings(max_examples=60, deadline=None)
@given(components())
def test_property_normalised_and_not_mutated(parts):
    base, experts = parts
    copies = [base.clone()] + [e.clone() for e in experts]
    composed = compose_logprobs(base, experts)
    torch.testing.assert_close(composed.exp().sum(-1), torch.ones(base.shape[0]), atol=1e-5, rtol=0)
    for before, after in zip(copies, [base, *experts]):
        assert torch.equal(before, after)


@settings(max_examples=60, deadline=None)
@given(components(), st.randoms())
def test_property_order_of_experts_does_not_matter(parts, rng):
    base, experts = parts
    shuffled = list(experts)
    rng.shuffle(shuffled)
    torch.testing.assert_close(compose_logprobs(base, experts), compose_logprobs(base, shuffled), atol=1e-4, rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(components())
def test_property_identity_cases(parts):
    base, experts = parts
    torch.testing.assert_close(
        compose_logprobs(base, [experts[0]]), torch.log_softmax(experts[0], -1), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        compose_logprobs(base, [base] * len(experts)), torch.log_softmax(base, -1), atol=1e-4, rtol=1e-5
    )


@settings(max_examples=40, deadline=None)
@given(components())
def test_property_matches_explicit_product_of_experts(parts):
    base, experts = parts
    # p̂ ∝ p_b · Π p_i / p_b, computed directly in float64 probability space.
    pb = torch.softmax(base.double(), -1)
    product = pb.clone()
    for expert in experts:
        product = product * torch.softmax(expert.double(), -1) / pb
    expected = (product / product.sum(-1, keepdim=True)).float()
    torch.testing.assert_close(compose_logprobs(base, experts).exp(), expected, atol=1e-5, rtol=1e-4)
