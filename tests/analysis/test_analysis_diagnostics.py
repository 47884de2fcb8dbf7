"""The overlap diagnostics on hand-built tensors: golden values, library equivalence, exact cases."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from scipy.special import rel_entr

from mergecompose.analysis import delta_overlap as ox
from mergecompose.analysis import diagnostics as dx
from mergecompose.composition import compose_logprobs


def _log(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).log().float()


# ------------------------------------------------------------------------------------ divergences


def test_kl_golden_value_and_zero_probability_terms():
    p = _log([0.5, 0.5, 0.0])
    q = _log([0.25, 0.25, 0.5])
    assert dx.kl_divergence(p, q).item() == pytest.approx(math.log(2), abs=1e-6)
    # Swapped, p gives mass where q has none: +inf.
    assert math.isinf(dx.kl_divergence(q, p).item())


def test_kl_matches_torch_kl_div_and_scipy():
    torch.manual_seed(0)
    p, q = torch.randn(3, 4, 11), torch.randn(3, 4, 11)
    ours = dx.kl_divergence(p, q)
    lp, lq = torch.log_softmax(p, -1), torch.log_softmax(q, -1)
    torch.testing.assert_close(ours, F.kl_div(lq, lp, log_target=True, reduction="none").sum(-1), atol=1e-6, rtol=1e-5)
    scipy_value = rel_entr(lp.exp().double().numpy(), lq.exp().double().numpy()).sum(-1)
    torch.testing.assert_close(ours.double(), torch.from_numpy(scipy_value), atol=1e-6, rtol=1e-5)


def test_conditional_kl_equals_kl_of_renormalised_restrictions():
    torch.manual_seed(1)
    p, q = torch.randn(5, 9), torch.randn(5, 9)
    subset = torch.rand(5, 9) > 0.4
    subset[0] = False  # an empty subset gives 0
    ours = dx.conditional_kl(p, q, subset)
    for row in range(5):
        if not subset[row].any():
            assert ours[row].item() == 0.0
            continue
        pp = torch.softmax(p[row].double(), -1)[subset[row]]
        qq = torch.softmax(q[row].double(), -1)[subset[row]]
        expected = rel_entr((pp / pp.sum()).numpy(), (qq / qq.sum()).numpy()).sum()
        assert ours[row].item() == pytest.approx(expected, abs=1e-6)


# ------------------------------------------------------------------------------------ activity


def test_activity_is_kl_of_expert_from_base():
    torch.manual_seed(2)
    base, experts = torch.randn(2, 3, 7), torch.randn(2, 2, 3, 7)
    activity = dx.expert_activity(base, experts)
    assert activity.shape == (2, 2, 3)
    torch.testing.assert_close(activity[1], dx.kl_divergence(experts[1], base))
    # An expert equal to the base (up to a logit shift) is inactive.
    assert dx.expert_activity(base, (base + 3.0)[None]).abs().max().item() < 1e-6


def test_coactivation_rate_golden():
    activity = torch.tensor([[0.5, 0.5, 0.0, 2.0], [0.2, 0.0, 0.0, 0.05]])  # (k=2, N=4)
    assert dx.coactivation_rate(activity, 0.1) == pytest.approx(1 / 4)
    assert dx.coactivation_rate(activity, 0.01) == pytest.approx(2 / 4)
    assert dx.coactivation_rate(activity, 1.0) == 0.0
    mask = torch.tensor([True, False, False, True])
    assert dx.coactivation_rate(activity, 0.01, mask) == pytest.approx(2 / 2)


def test_active_intervals_and_intersections_golden():
    activity = torch.zeros(3, 2, 6)
    activity[0, 0] = torch.tensor([0, 0.5, 0, 0.5, 0, 0])  # [1, 4): the gap at 2 is inside the phase
    activity[1, 0] = torch.tensor([0, 0, 0, 0.5, 0.5, 0.5])  # [3, 6)
    # expert 2 never active in row 0; row 1: expert 0 at [0, 1), expert 2 at [2, 3)
    activity[0, 1, 0] = 1.0
    activity[2, 1, 2] = 1.0
    intervals = dx.active_intervals(activity, 0.1)
    assert intervals[:, 0].tolist() == [[1, 4], [3, 6], [-1, -1]]
    assert intervals[:, 1].tolist() == [[0, 1], [-1, -1], [2, 3]]
    intersections = dx.interval_intersections(intervals)
    assert intersections[0, 1].tolist() == [1, 0]
    assert intersections[0, 2].tolist() == [0, 0]
    assert intersections[0, 0].tolist() == [3, 1]
    # A masked-out position does not count as active.
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, 3] = False
    assert dx.active_intervals(activity, 0.1, mask)[0, 0].tolist() == [1, 2]


# ------------------------------------------------------------------------------------ vocabulary


def test_centred_deltas_subtract_the_median():
    torch.manual_seed(3)
    base = torch.randn(5)
    delta = torch.tensor([0.1, 0.5, -0.3, 0.2, 0.0])
    expert = torch.log_softmax(base + delta, -1)  # ℓ − b = δ + constant
    centred = ox.centred_deltas(base, expert[None])[0]
    torch.testing.assert_close(centred, torch.tensor([0.0, 0.4, -0.4, 0.1, -0.1]), atol=1e-6, rtol=0)


def test_weighted_overlap_and_sign_conflict_golden():
    delta_i = torch.tensor([1.0, -2.0, 0.0])
    delta_j = torch.tensor([2.0, 1.0, 0.0])
    weight = torch.tensor([1.0, 0.5, 1.0])
    # Σw|δi||δj| = 1·1·2 + 0.5·2·1 = 3; Σwδi² = 1 + 0.5·4 = 3; Σwδj² = 4 + 0.5·1 = 4.5
    assert ox.weighted_overlap(delta_i, delta_j, weight).item() == pytest.approx(3 / math.sqrt(13.5), rel=1e-6)
    # Signs differ only at token 1, which carries 1 of the 3.
    assert ox.sign_conflict_mass(delta_i, delta_j, weight).item() == pytest.approx(1 / 3, rel=1e-6)
    # Disjoint deltas, or a zero delta: overlap 0.
    assert ox.weighted_overlap(torch.tensor([1.0, 0, 0]), torch.tensor([0, 0, 1.0]), weight).item() == 0.0
    assert ox.weighted_overlap(torch.zeros(3), delta_j, weight).item() == 0.0
    # A delta with itself: overlap 1, no conflict; with its negation: overlap 1, all conflict.
    assert ox.weighted_overlap(delta_i, delta_i, weight).item() == pytest.approx(1.0)
    assert ox.sign_conflict_mass(delta_i, -delta_i, weight).item() == pytest.approx(1.0)


def test_overlap_weights_are_the_largest_probability():
    base, ei, ej, q = _log([0.7, 0.3]), _log([0.2, 0.8]), _log([0.5, 0.5]), _log([0.6, 0.4])
    torch.testing.assert_close(ox.overlap_weights(base, ei, ej, q), torch.tensor([0.7, 0.8]))


def test_supports_need_both_a_large_delta_and_mass():
    centred = torch.tensor([[[2.0, 2.0, 0.01, 0.0]]])  # (k=1, N=1, V=4)
    base = _log([[0.5, 1e-6, 0.3, 0.2 - 1e-6]])
    expert = base[None]
    supports = ox.delta_supports(centred, base, expert, epsilon=0.1, eta=1e-3)
    assert supports.tolist() == [[[True, False, False, False]]]


# ------------------------------------------------------------------------------------ exact cases


def _token_factorized(seed: int = 4):
    """Base random; expert 1 moves tokens {0, 1, 2} only, expert 2 tokens {8, 9} only."""
    torch.manual_seed(seed)
    base = torch.log_softmax(torch.randn(3, 5, 16), -1)  # (B, T, V)
    bump_1 = torch.zeros(16)
    bump_1[:3] = torch.tensor([3.0, -2.0, 1.0])
    bump_2 = torch.zeros(16)
    bump_2[8:10] = torch.tensor([-1.5, 2.5])
    experts = torch.stack([torch.log_softmax(base + bump_1, -1), torch.log_softmax(base + bump_2, -1)])
    return base, experts


def test_factorized_supports_give_zero_overlap_and_zero_projective_error():
    base, experts = _token_factorized()
    composed = compose_logprobs(base, list(experts))
    centred = ox.centred_deltas(base, experts)
    supports = ox.delta_supports(centred, base, experts, epsilon=0.1, eta=0.0)
    assert not supports[0][..., 3:].any() and supports[0][..., :3].all()
    assert not (supports[1][..., :8].any() or supports[1][..., 10:].any()) and supports[1][..., 8:10].all()
    weight = ox.overlap_weights(base, experts[0], experts[1], composed)
    assert ox.weighted_overlap(centred[0], centred[1], weight).abs().max().item() < 1e-5
    error = dx.restricted_projective_error(base, experts, composed, supports)
    assert error.shape == (2, 3, 5)
    assert error.abs().max().item() < 1e-6
    # The composition is far from each single expert, so a zero here is not trivial.
    assert dx.kl_divergence(experts[0], composed).min().item() > 1e-2


def test_time_factorized_experts_give_zero_coactivation_and_zero_single_active_error():
    torch.manual_seed(5)
    base = torch.log_softmax(torch.randn(2, 8, 16), -1)
    experts = base[None].repeat(2, 1, 1, 1).clone()
    experts[0, :, 1:3] = torch.log_softmax(torch.randn(2, 2, 16) * 3, -1)  # expert 1 acts at t ∈ [1, 3)
    experts[1, :, 5:7] = torch.log_softmax(torch.randn(2, 2, 16) * 3, -1)  # expert 2 acts at t ∈ [5, 7)
    composed = compose_logprobs(base, list(experts))
    activity = dx.expert_activity(base, experts)
    assert dx.coactivation_rate(activity, 0.01) == 0.0
    intervals = dx.active_intervals(activity, 0.01)
    assert intervals[0].tolist() == [[1, 3], [1, 3]] and intervals[1].tolist() == [[5, 7], [5, 7]]
    assert dx.interval_intersections(intervals)[0, 1].tolist() == [0, 0]
    error, eligible = dx.single_active_error(base, experts, composed, dx.active_experts(activity, 0.01))
    assert eligible.all()
    assert error.abs().max().item() < 1e-5
    assert activity.max().item() > 0.5  # the experts do act


def test_overlapping_experts_give_positive_overlap_conflict_and_projective_error():
    torch.manual_seed(6)
    base = torch.log_softmax(torch.randn(3, 5, 16), -1)
    bump = torch.zeros(16)
    bump[:3] = torch.tensor([3.0, -2.0, 1.0])
    # Expert 2 moves the same three tokens: against expert 1 on tokens 0 and 1, with it on token 2.
    bump_2 = torch.zeros(16)
    bump_2[:3] = torch.tensor([-1.0, 2.0, 0.5])
    experts = torch.stack([torch.log_softmax(base + bump, -1), torch.log_softmax(base + bump_2, -1)])
    composed = compose_logprobs(base, list(experts))
    centred = ox.centred_deltas(base, experts)
    supports = ox.delta_supports(centred, base, experts, epsilon=0.1, eta=0.0)
    weight = ox.overlap_weights(base, experts[0], experts[1], composed)
    assert ox.weighted_overlap(centred[0], centred[1], weight).min().item() > 0.1
    assert ox.sign_conflict_mass(centred[0], centred[1], weight).min().item() > 0.1
    error = dx.restricted_projective_error(base, experts, composed, supports)
    assert error.min().item() > 1e-2
    activity = dx.expert_activity(base, experts)
    single, eligible = dx.single_active_error(base, experts, composed, dx.active_experts(activity, 1e6))
    assert eligible.all() and single.min().item() > 1e-2  # "no expert active" is wrong here: q ≠ p_b


def test_single_active_error_golden_reference_choice():
    base = _log([[0.5, 0.5], [0.5, 0.5]])
    experts = torch.stack([_log([[0.9, 0.1], [0.5, 0.5]]), _log([[0.5, 0.5], [0.2, 0.8]])])
    composed = _log([[0.8, 0.2], [0.5, 0.5]])
    # (k, N): position 0 has expert 0 alone (eligible), position 1 has both (not eligible).
    active = torch.tensor([[True, True], [False, True]])
    error, eligible = dx.single_active_error(base, experts, composed, active)
    assert eligible.tolist() == [True, False]
    expected = 0.9 * math.log(0.9 / 0.8) + 0.1 * math.log(0.1 / 0.2)
    assert error[0].item() == pytest.approx(expected, abs=1e-6)
    assert error[1].item() == 0.0
    active_none = torch.zeros(2, 2, dtype=torch.bool)
    error, _ = dx.single_active_error(base, experts, composed, active_none)
    assert error[0].item() == pytest.approx(dx.kl_divergence(base[0], composed[0]).item())


# ------------------------------------------------------------------------------------ linear case


def test_linear_logits_give_zero_gap_residual_and_linearization_error():
    torch.manual_seed(7)
    base = torch.randn(2, 4, 12)
    deltas = torch.randn(2, 2, 4, 12)
    lam = 0.7
    experts = base + deltas  # logits z_i
    scaled = base + lam * deltas  # z(θ_b + λτ_i) for a linear map
    merged = base + lam * deltas.sum(0) + 5.0  # z(θ_b + λΣτ_i), shifted: softmax ignores it
    composed = compose_logprobs(base, list(experts), weights=[lam, lam])
    assert dx.merge_compose_gap(composed, merged).max().item() < 1e-6
    assert dx.top1_agreement(composed, merged).all()
    assert dx.interaction_residual(merged, scaled, base).abs().max().item() < 1e-5
    for index in range(2):
        assert dx.linearization_error(scaled[index], base, experts[index], lam).max().item() < 1e-6
    # A non-linear merge: the residual is exactly the added term, centred.
    extra = torch.randn(2, 4, 12)
    residual = dx.interaction_residual(merged + extra, scaled, base)
    torch.testing.assert_close(residual, extra - extra.mean(-1, keepdim=True), atol=1e-5, rtol=1e-5)
    assert dx.merge_compose_gap(composed, merged + extra).min().item() > 1e-3


def test_bad_arguments_raise_value_errors_naming_them():
    with pytest.raises(ValueError, match="`p` and `q`"):
        dx.kl_divergence(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="`epsilon`"):
        dx.active_experts(torch.zeros(2, 3), -1.0)
    with pytest.raises(ValueError, match="`eta`"):
        ox.delta_supports(torch.zeros(1, 3), torch.zeros(3), torch.zeros(1, 3), 0.1, 1.5)
    with pytest.raises(ValueError, match="`experts`"):
        dx.expert_activity(torch.zeros(2, 3), torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match="`activity`"):
        dx.active_intervals(torch.zeros(2, 3), 0.1)


def test_weighted_median_golden_and_base_weighted_centre():
    values = torch.tensor([[3.0, 1.0, 2.0], [5.0, 4.0, 6.0]])
    weights = torch.tensor([[0.6, 0.2, 0.2], [1.0, 1.0, 1.0]])
    # Row 0: sorted 1, 2, 3 with weights 0.2, 0.2, 0.6 → cumulative 0.2, 0.4, 1.0 → 3.
    # Row 1: equal weights, odd V → the plain median 5.
    assert ox.weighted_median(values, weights).flatten().tolist() == [3.0, 5.0]
    torch.testing.assert_close(
        ox.weighted_median(values[1:], torch.ones(3)), values[1:].median(-1, keepdim=True).values
    )
    # A peaked base: 0.9 of its mass on token 0. The expert moves token 1 and its tail drifts
    # (tokens 2-4 down by 2), so the plain median sits in the drift; the base-weighted one at token 0.
    base = _log([0.9, 0.04, 0.02, 0.02, 0.02])
    delta = torch.tensor([0.0, 3.0, -2.0, -2.0, -2.0])
    expert = torch.log_softmax(base + delta, -1)[None]
    plain = ox.centred_deltas(base, expert)[0]
    weighted = ox.centred_deltas(base, expert, centre="base_weighted_median")[0]
    torch.testing.assert_close(plain, delta + 2.0, atol=1e-5, rtol=0)
    torch.testing.assert_close(weighted, delta, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="`centre`"):
        ox.centred_deltas(base, expert, centre="mean")


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_kernels_on_normalised_inputs_equal_the_normalising_functions():
    """The `*_from_logprobs` / `*_from_probs` kernels the accumulator uses: same values, no re-normalisation.

    Equal up to rounding: log-softmax of log-probs is not bit-exactly the identity.
    """
    torch.manual_seed(5)
    base = torch.log_softmax(torch.randn(3, 4, 12) * 2, -1)  # (batch, seq, vocab)
    experts = torch.log_softmax(base + torch.randn(2, 3, 4, 12), -1)  # (k, batch, seq, vocab)
    composed = compose_logprobs(base, list(experts))
    base_p, experts_p, composed_p = base.exp(), experts.exp(), composed.exp()
    _close(dx.kl_from_logprobs(experts, experts_p, base), dx.expert_activity(base, experts))
    for centre in ox.CENTRES:
        centred = ox.centred_deltas_from_logprobs(base, experts, centre=centre, base_probs=base_p)
        _close(centred, ox.centred_deltas(base, experts, centre=centre))
    supports = ox.delta_supports_from_probs(centred, base_p, experts_p, 0.1, 1e-3)
    assert torch.equal(supports, ox.delta_supports(centred, base, experts, 0.1, 1e-3))
    assert 0 < int(supports.sum()) < supports.numel()
    weight = ox.overlap_weights_from_probs(base_p, experts_p[0], experts_p[1], composed_p)
    _close(weight, ox.overlap_weights(base, experts[0], experts[1], composed))
    active = dx.expert_activity(base, experts) > 0.1
    single, eligible = dx.single_active_error_from_logprobs(base, experts, composed, active)
    reference_single, reference_eligible = dx.single_active_error(base, experts, composed, active)
    _close(single, reference_single)
    assert torch.equal(eligible, reference_eligible)
    restricted = dx.restricted_projective_error_from_logprobs(experts, experts_p, composed, composed_p, supports)
    _close(restricted, dx.restricted_projective_error(base, experts, composed, supports))
    # Unnormalised logits are taken as they are: a shift changes the kernel's KL, not expert_activity's.
    shifted = base + 1.0
    assert not torch.allclose(dx.kl_from_logprobs(experts, experts_p, shifted), dx.expert_activity(shifted, experts))
