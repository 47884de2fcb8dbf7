"""Remedies for composing many experts: gating, plausibility, termination."""

import math
import warnings

import pytest
import torch

from mergecompose.composition import (
    ActivityGate,
    ComposedLM,
    PlausibilityFilter,
    TerminationRule,
    compose_logprobs,
    compose_with_remedies,
    compose_with_remedies_unchecked,
)
from mergecompose.composition.remedies import check_remedies, kl_to_base


def log(values):
    return torch.tensor(values, dtype=torch.float32).log()


def test_no_remedies_is_the_plain_rule():
    torch.manual_seed(0)
    components = torch.randn(4, 2, 3, 10)
    expected = compose_logprobs(components[0], list(components[1:]), [1.0, 0.5, 2.0])
    torch.testing.assert_close(compose_with_remedies(components, [1.0, 0.5, 2.0]), expected)


def test_kl_to_base_golden():
    base = log([0.5, 0.5])
    expert = log([0.75, 0.25])
    expected = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    torch.testing.assert_close(kl_to_base(torch.stack([base, expert])), torch.tensor([expected]))
    # Terms where the expert gives 0 count 0, even where the base also gives 0.
    zero = torch.stack([log([1.0, 0.0]), log([1.0, 0.0])])
    assert kl_to_base(zero).item() == 0.0


def test_activity_gate_removes_inactive_experts_noise():
    base = log([[0.4, 0.3, 0.3], [0.4, 0.3, 0.3]])  # two positions
    skilled = log([[0.05, 0.9, 0.05], [0.4, 0.3, 0.3]])  # active at position 0 only
    noisy = log([[0.42, 0.29, 0.29], [0.38, 0.31, 0.31]])  # a small deviation everywhere
    components = torch.stack([base, skilled, noisy])  # (3, 2, V)
    gated = compose_with_remedies(components, remedies=[ActivityGate(threshold=0.05)])
    # Position 0: only the skilled expert is active -> exactly that expert. Position 1: the base.
    torch.testing.assert_close(gated[0], skilled[0])
    torch.testing.assert_close(gated[1], base[1])
    plain = compose_with_remedies(components)
    assert not torch.allclose(plain[1], base[1])  # without the gate the noise shows


def test_plausibility_filter_keeps_the_union_of_plausible_sets():
    base = log([0.7, 0.2, 0.05, 0.05])
    expert = log([0.1, 0.1, 0.75, 0.05])
    composed = compose_with_remedies(torch.stack([base, expert]), remedies=[PlausibilityFilter(alpha=0.25)])
    # Plausible: base {0 (0.7), 1 (0.2 >= 0.175)}, expert {2}; token 3 is below both thresholds.
    assert composed[3] == -math.inf
    assert torch.isfinite(composed[:3]).all()
    plain = compose_logprobs(base, [expert])
    expected = torch.log_softmax(plain[:3], -1)
    torch.testing.assert_close(composed[:3], expected)


def test_plausibility_top_p():
    base = log([0.6, 0.3, 0.06, 0.04])
    expert = log([0.6, 0.3, 0.06, 0.04])
    composed = compose_with_remedies(torch.stack([base, expert]), remedies=[PlausibilityFilter(alpha=None, top_p=0.8)])
    # Nucleus of 0.8: tokens 0 and 1 (0.6 < 0.8, then 0.9 >= 0.8).
    assert torch.isinf(composed[2:]).all() and torch.isfinite(composed[:2]).all()


def test_termination_rule_gives_eos_the_base_probability():
    eos = 3
    base = log([0.3, 0.3, 0.3, 0.1])
    expert_1 = log([0.1, 0.4, 0.1, 0.4])
    expert_2 = log([0.4, 0.1, 0.1, 0.4])
    components = torch.stack([base, expert_1, expert_2])
    composed = compose_with_remedies(components, remedies=[TerminationRule(eos)])
    plain = compose_logprobs(base, [expert_1, expert_2])
    torch.testing.assert_close(composed.exp().sum(), torch.tensor(1.0))
    torch.testing.assert_close(composed[eos].exp(), torch.tensor(0.1))
    # The other tokens keep their relative composed probabilities.
    torch.testing.assert_close(composed[:3] - composed[:3].logsumexp(-1), plain[:3] - plain[:3].logsumexp(-1))


def test_termination_rule_from_active_experts():
    eos = 2
    base = log([0.45, 0.45, 0.1])
    active = log([0.1, 0.3, 0.6])
    idle = base.clone()
    composed = compose_with_remedies(
        torch.stack([base, active, idle]), remedies=[TerminationRule(eos, source="active", threshold=0.05)]
    )
    torch.testing.assert_close(composed[eos].exp(), torch.tensor(0.6))
    # With no expert active, EOS falls back to the base's probability.
    fallback = compose_with_remedies(torch.stack([base, idle, idle]), remedies=[TerminationRule(eos, source="active")])
    torch.testing.assert_close(fallback[eos].exp(), torch.tensor(0.1))


def test_termination_after_a_plausibility_filter_that_leaves_only_eos_or_rules_it_out():
    eos = 2
    # Every component is sure of EOS: the filter keeps EOS alone, which keeps all the mass.
    sure = log([0.001, 0.001, 0.998])
    only_eos = compose_with_remedies(
        torch.stack([sure, sure, sure]), remedies=[PlausibilityFilter(alpha=0.1), TerminationRule(eos)]
    )
    torch.testing.assert_close(only_eos, torch.tensor([-math.inf, -math.inf, 0.0]))
    # No component finds EOS plausible: it stays ruled out, the rest keeps the filtered composition.
    never = log([0.6, 0.39, 0.01])
    components = torch.stack([never, never, never])
    filtered = compose_with_remedies(components, remedies=[PlausibilityFilter(alpha=0.1)])
    with_rule = compose_with_remedies(components, remedies=[PlausibilityFilter(alpha=0.1), TerminationRule(eos)])
    assert not torch.isnan(with_rule).any()
    torch.testing.assert_close(with_rule, filtered)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ActivityGate(threshold=-1), "`threshold` must be >= 0"),
        (lambda: PlausibilityFilter(alpha=None, top_p=None), "needs `alpha` or `top_p`"),
        (lambda: PlausibilityFilter(alpha=1.5), r"`alpha` must be in \(0, 1\], got 1.5"),
        (lambda: TerminationRule(2, source="experts"), "`source` must be 'base' or 'active'"),
        (lambda: compose_with_remedies(torch.zeros(2, 4), remedies=["gate"]), "unknown remedy"),
    ],
)
def test_bad_remedy_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_composed_lm_with_a_gate_that_nothing_passes_decodes_like_the_base(base_model, expert_models):
    composed = ComposedLM(base_model, expert_models, remedies=[ActivityGate(threshold=1e9)])
    ids = torch.tensor([[5, 9, 14, 3], [7, 22, 40, 11]])
    out = composed.generate(ids, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    expected = base_model.generate(
        ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert torch.equal(out, expected)
    torch.testing.assert_close(composed.logprobs(ids), torch.log_softmax(base_model(ids).logits, -1))


def test_unchecked_composition_and_the_deprecated_validate():
    torch.manual_seed(0)
    components = torch.randn(3, 2, 4, 8)
    remedies = [ActivityGate(0.05), PlausibilityFilter(0.1), TerminationRule(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning without `validate`
        checked = compose_with_remedies(components, [1.0, 0.5], remedies)
    assert torch.equal(compose_with_remedies_unchecked(components, [1.0, 0.5], remedies), checked)
    for validate in (True, False):
        with pytest.deprecated_call(match=r"`compose_with_remedies\(..., validate=...\)` is deprecated"):
            assert torch.equal(compose_with_remedies(components, [1.0, 0.5], remedies, validate=validate), checked)
    with pytest.deprecated_call():  # validate=False skipped the checks of values
        assert torch.isnan(compose_with_remedies(components * math.nan, validate=False)).all()
    with pytest.raises(ValueError, match="must be below the vocabulary size 8, got 99"):
        check_remedies([TerminationRule(99)], 8)
    with pytest.raises(ValueError, match="at most one TerminationRule"):
        check_remedies([TerminationRule(2), TerminationRule(3)], 8)
