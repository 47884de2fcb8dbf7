"""Top-1 token shifts, shift agreement, the delta-norm ratio and the dominant-shift projective error: by hand on
V = 4, streamed over batches, through `measure_overlap`, and in the flat diagnostics."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from mergecompose.analysis import delta_overlap as ox
from mergecompose.analysis import diagnostics as dx
from mergecompose.analysis import measure_overlap
from mergecompose.analysis import shift_diagnostics as sx
from mergecompose.analysis.measure import model_logprobs
from mergecompose.analysis.overlap_settings import OverlapSettings
from mergecompose.analysis.predict import (
    CENTRES,
    INTERFERENCE_STATISTICS,
    PROXY_OWNER_STATISTICS,
    check_rule_diagnostics,
    diagnostic_names,
    flatten_report,
    load_rule,
    undefined_reasons,
)
from mergecompose.analysis.streaming import OverlapAccumulator
from mergecompose.composition import ComposedLM, compose_logprobs

# Three positions over V = 4, as probabilities. Top-1 tokens: base (0, 1, 2), expert 1 (1, 2, 2), expert 2
# (1, 1, 3): expert 1 shifts at t0 and t1, expert 2 at t0 and t2; at t0 both shift, to the same token 1.
# Every KL(p_i ‖ p_b) is above 0.01 (the least, expert 2 at t1, is 0.5 ln(5/6) + 0.3 ln(3/2) ≈ 0.030), so at
# ε = 0.01 every position is co-active and the single-active projective error is undefined.
P_BASE = [[0.4, 0.3, 0.2, 0.1], [0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.4, 0.1]]
P_1 = [[0.2, 0.5, 0.2, 0.1], [0.1, 0.2, 0.6, 0.1], [0.35, 0.15, 0.4, 0.1]]
P_2 = [[0.1, 0.6, 0.2, 0.1], [0.1, 0.5, 0.3, 0.1], [0.1, 0.1, 0.2, 0.6]]
# Expert 2 without its shift at t0 (top-1 token 0, as the base's): no position is shifted by both.
P_2_APART = [[0.5, 0.3, 0.1, 0.1], *P_2[1:]]

# The composition at weights 1 is q ∝ p_1 p_2 / p_b. At t1 that is (0.1, 1/6, 0.9, 0.1) / (19/15) =
# (3, 5, 27, 3) / 38, so KL(p_1 ‖ q) = 0.2 ln(38/30) + 0.2 ln(38/25) + 0.6 ln(38/45); at t2 it is
# (0.14, 0.06, 0.2, 0.6), already normalised, so KL(p_2 ‖ q) = 0.1 ln(5/7) + 0.1 ln(5/3).
ERROR_T1 = 0.2 * math.log(38 / 30) + 0.2 * math.log(38 / 25) + 0.6 * math.log(38 / 45)
ERROR_T2 = 0.1 * math.log(5 / 7) + 0.1 * math.log(5 / 3)
# With P_2_APART, at t0 q ∝ (0.25, 0.5, 0.1, 0.1) / 0.95 = (5, 10, 2, 2) / 19 and its owner is expert 1:
# KL(p_1 ‖ q) = 0.2 ln(0.76) + 0.5 ln(0.95) + 0.2 ln(1.9) + 0.1 ln(0.95).
ERROR_T0_APART = 0.2 * math.log(0.76) + 0.6 * math.log(0.95) + 0.2 * math.log(1.9)


def _log(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).log().float()


def _case(expert_2=P_2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(base (3, 4), experts (2, 3, 4), composed (3, 4))` log-probs."""
    base, experts = _log(P_BASE), torch.stack([_log(P_1), _log(expert_2)])
    return base, experts, compose_logprobs(base, list(experts))


# ------------------------------------------------------------------------------------ by hand


def test_top1_tokens_and_shifts_by_hand():
    base, experts, _ = _case()
    tokens = sx.top1_tokens(base, experts)
    assert tokens.tolist() == [[0, 1, 2], [1, 2, 2], [1, 1, 3]]
    assert sx.top1_shifts(tokens).tolist() == [[True, True, False], [True, False, True]]
    # Logits give the same tokens as their log-probs; ties go to the lowest token id.
    assert torch.equal(sx.top1_tokens(base * 3 + 1, experts - 2), tokens)
    tied = torch.zeros(1, 4)
    assert sx.top1_tokens(tied, tied[None]).tolist() == [[0], [0]]


def test_shift_rate_and_agreement_by_hand():
    base, experts, _ = _case()
    counts = sx.shift_counts(sx.top1_tokens(base, experts))
    assert int(counts.positions) == 3
    assert counts.shifted.tolist() == [2, 2]
    assert counts.both_shifted.tolist() == [[2, 1], [1, 2]]
    assert counts.same_token.tolist() == [[2, 1], [1, 2]]
    assert sx.top1_shift_rate(counts).tolist() == pytest.approx([2 / 3, 2 / 3])
    agreement = sx.shift_agreement(counts)
    assert agreement.both_shift_rate[0, 1].item() == pytest.approx(1 / 3)
    assert agreement.same_token_share[0, 1].item() == 1.0
    # Only t2 and t1 are counted: expert 1 shifts at t1, expert 2 at t2, never both.
    masked = sx.shift_counts(sx.top1_tokens(base, experts), mask=torch.tensor([False, True, True]))
    assert int(masked.positions) == 2 and masked.shifted.tolist() == [1, 1]
    assert sx.shift_agreement(masked).both_shift_rate[0, 1].item() == 0.0
    assert math.isnan(sx.shift_agreement(masked).same_token_share[0, 1].item())


def test_shifts_to_different_tokens_give_a_same_token_share_of_zero():
    base, experts, _ = _case()
    experts = experts.clone()
    experts[1, 0] = _log([0.1, 0.2, 0.6, 0.1])  # expert 2 now shifts t0 to token 2, expert 1 to token 1
    agreement = sx.shift_agreement(sx.shift_counts(sx.top1_tokens(base, experts)))
    assert agreement.both_shift_rate[0, 1].item() == pytest.approx(1 / 3)
    assert agreement.same_token_share[0, 1].item() == 0.0


def test_no_position_shifted_by_both_leaves_the_same_token_share_undefined():
    base, experts, _ = _case(P_2_APART)
    counts = sx.shift_counts(sx.top1_tokens(base, experts))
    assert counts.shifted.tolist() == [2, 1] and counts.both_shifted[0, 1].item() == 0
    agreement = sx.shift_agreement(counts)
    assert agreement.both_shift_rate[0, 1].item() == 0.0
    assert math.isnan(agreement.same_token_share[0, 1].item())
    assert agreement.same_token_share[0, 0].item() == 1.0  # an expert always shifts to its own token


def test_dominant_shift_error_is_defined_where_every_position_is_co_active():
    base, experts, composed = _case()
    activity = dx.expert_activity(base, experts)
    assert activity.min().item() > 0.01  # every expert is active at every position
    _, single_eligible = dx.single_active_error(base, experts, composed, dx.active_experts(activity, 0.01))
    assert not single_eligible.any()  # the single-active error has no position
    error, eligible = sx.dominant_shift_error(base, experts, composed)
    assert eligible.tolist() == [False, True, True]  # t0 is shifted by both, t1 by expert 1, t2 by expert 2
    assert error.tolist() == pytest.approx([0.0, ERROR_T1, ERROR_T2], abs=1e-6)
    assert error[eligible].mean().item() == pytest.approx((ERROR_T1 + ERROR_T2) / 2, abs=1e-6)


def test_dominant_shift_error_by_hand_where_no_position_is_shifted_by_both():
    base, experts, composed = _case(P_2_APART)
    error, eligible = sx.dominant_shift_error(base, experts, composed)
    assert eligible.all()
    assert error.tolist() == pytest.approx([ERROR_T0_APART, ERROR_T1, ERROR_T2], abs=1e-6)


def test_dominant_shift_error_is_zero_where_the_owner_is_the_only_expert_that_moves():
    """The projective case: the one shifting expert owns the step and the other equals the base there."""
    base, experts, _ = _case()
    experts = experts.clone()
    experts[1, 1] = base[1]  # at t1 only expert 1 moves
    error, eligible = sx.dominant_shift_error(base, experts, compose_logprobs(base, list(experts)))
    assert eligible[1] and error[1].item() < 1e-6
    assert error[2].item() > 1e-3  # at t2 expert 1 moves too, without shifting: a real error


def test_delta_norm_ratio_by_hand():
    centred_i = torch.tensor([[1.0, -1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    centred_j = torch.tensor([[0.5, 0.0, 0.0, 0.5], [0.0, 0.0, 1.0, 0.0]])
    weight = torch.tensor([[0.5] * 4, [1.0] * 4])
    # S_i = 0.5 (1 + 1) + 1 · 4 = 5, S_j = 0.5 (0.25 + 0.25) + 1 · 1 = 1.25: sqrt(5 / 1.25) = 2, either way round.
    assert ox.delta_norm_ratio(centred_i, centred_j, weight).item() == pytest.approx(2.0)
    assert ox.delta_norm_ratio(centred_j, centred_i, weight).item() == pytest.approx(2.0)
    assert ox.delta_norm_ratio(centred_i, 3 * centred_i, weight).item() == pytest.approx(3.0)
    zero = torch.zeros_like(centred_j)
    assert math.isinf(ox.delta_norm_ratio(centred_i, zero, weight).item())
    assert math.isnan(ox.delta_norm_ratio(zero, zero, weight).item())


# ------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: sx.top1_tokens(torch.zeros(3, 4), torch.zeros(2, 3, 5)),
            r"`experts` must have shape .* = \(k, 3, 4\), got \(2, 3, 5\)",
        ),
        (lambda: sx.top1_shifts(torch.zeros(3, 4)), r"`tokens` must be an integer tensor .* got dtype torch.float32"),
        (lambda: sx.top1_shifts(torch.zeros(1, 4, dtype=torch.long)), r"`tokens` .*k ≥ 1.* shape \(1, 4\)"),
        (
            lambda: sx.shift_counts(torch.zeros(3, 4, dtype=torch.long), mask=torch.ones(5, dtype=torch.bool)),
            r"`mask` must have the positions' shape .* \(4,\), got \(5,\)",
        ),
        (
            lambda: sx.top1_shift_rate(sx.shift_counts(torch.zeros(3, 0, dtype=torch.long))),
            r"`counts` must count at least one position, got positions = 0",
        ),
        (
            lambda: sx.shift_agreement(sx.shift_counts(torch.zeros(3, 0, dtype=torch.long))),
            r"`counts` must count at least one position",
        ),
        (
            lambda: sx.dominant_shift_error_from_tokens(torch.zeros(3, 4, dtype=torch.long), torch.zeros(3, 4)),
            r"`expert_kl` must be \(k, \.\.\.\) = \(2, 4\).* got \(3, 4\)",
        ),
        (
            lambda: sx.dominant_shift_error(torch.zeros(3, 4), torch.zeros(2, 3, 4), torch.zeros(2, 4)),
            r"`composed` must have the base's shape \(3, 4\), got \(2, 4\)",
        ),
        (
            lambda: ox.delta_norm_ratio(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 5)),
            r"`centred_i`, `centred_j` and `weight` must have the same shape .* \(2, 4\), \(2, 4\) and \(2, 5\)",
        ),
    ],
)
def test_bad_input_is_a_value_error_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ------------------------------------------------------------------------------------ streamed


def _shifting_components(seed: int, batch: int = 3, seq: int = 8, vocab: int = 64) -> torch.Tensor:
    """A peaked base and two experts that each lift six tokens of their own (two shared) at about half the
    positions, and both lift the last token together at about a third: each shifts the base's top-1 token at
    some positions and not at others, alone or with the other, to one token or to two."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(batch, seq, vocab, generator=generator) * 3.0
    together = (torch.rand(batch, seq, generator=generator) < 0.3).float()  # (B, T)
    experts = []
    for first in (0, 4):
        expert = base + 0.3 * torch.randn(batch, seq, vocab, generator=generator)
        lifted = (torch.rand(batch, seq, 1, generator=generator) < 0.5).float()  # (B, T, 1)
        expert[..., first : first + 6] += 12.0 * lifted * torch.rand(batch, seq, 6, generator=generator)
        expert[..., -1] += 20.0 * together
        experts.append(expert)
    return torch.log_softmax(torch.stack([base, *experts]), -1)  # (k+1, B, T, V)


@pytest.mark.parametrize(
    "settings",
    [OverlapSettings(full_vocabulary=True, reservoir_size=2), OverlapSettings(candidates=2, reservoir_size=2)],
    ids=["full_vocabulary", "top_k_union"],
)
def test_streamed_values_equal_the_pure_functions_on_all_positions(settings):
    chunks = [_shifting_components(seed) for seed in (0, 1, 2)]
    masks = [torch.rand(3, 8, generator=torch.Generator().manual_seed(10 + seed)) > 0.25 for seed in range(3)]
    accumulator = OverlapAccumulator(["a", "b"], 64, settings=settings, chunk_positions=7)
    for components, mask in zip(chunks, masks):
        accumulator.update(components, mask)
    report = accumulator.report().to_dict()

    components = torch.cat([c[:, m] for c, m in zip(chunks, masks)], dim=1)  # (k+1, N, V)
    base, experts = components[0], components[1:]
    composed = compose_logprobs(base, list(experts))
    tokens = sx.top1_tokens(base, experts)  # (k+1, N)
    counts = sx.shift_counts(tokens)
    rates, agreement = sx.top1_shift_rate(counts), sx.shift_agreement(counts)
    error, eligible = sx.dominant_shift_error(base, experts, composed)
    # The data exercise every statistic: shifts alone and together, to one token and to two.
    assert 0 < int(counts.same_token[0, 1]) < int(counts.both_shifted[0, 1]) < int(counts.shifted.min())
    assert 0 < int(eligible.sum()) < int(counts.positions)
    if not settings.full_vocabulary:  # the base's top-1 token is not always among the measured columns U
        peak = torch.maximum(components.amax(0), composed)  # (N, V)
        columns = peak.topk(2, dim=-1).indices  # (N, 2)
        assert not (columns == tokens[0][:, None]).any(-1).all()

    assert report["num_positions"] == int(counts.positions)
    for index, name in enumerate(["a", "b"]):
        assert report["experts"][name]["top1_shift_rate"] == pytest.approx(float(rates[index]), rel=1e-12)
    pair = report["pairs"]["a|b"]
    assert pair["top1_both_shift_rate"] == pytest.approx(float(agreement.both_shift_rate[0, 1]), rel=1e-12)
    assert pair["top1_same_shift_share"] == pytest.approx(float(agreement.same_token_share[0, 1]), rel=1e-12)
    projective = report["projective_error"]
    assert projective["dominant_shift"] == pytest.approx(float(error[eligible].double().mean()), rel=1e-5)
    assert projective["dominant_shift_fraction"] == pytest.approx(float(eligible.double().mean()), rel=1e-12)
    if settings.full_vocabulary:  # on the top-k union the norms are taken over U
        centred = ox.centred_deltas(base, experts, centre=settings.centre)
        weight = ox.overlap_weights(base, experts[0], experts[1], composed)
        expected = ox.delta_norm_ratio(centred[0], centred[1], weight).item()
        assert pair["delta_norm_ratio"] == pytest.approx(expected, rel=1e-5)


def test_the_report_and_the_flat_diagnostics_where_every_position_is_co_active():
    """The hand-built case through the accumulator and `flatten_report`: the single-active error is undefined,
    the dominant-shift one is the hand value, and the undefined same-token share has a reason."""
    base, experts, _ = _case(P_2_APART)
    components = torch.cat([base[None], experts])[:, None]  # (k+1, 1, 3, V)
    settings = OverlapSettings(epsilon=0.01, epsilons=[0.01])
    reports = {}
    for centre in CENTRES:
        accumulator = OverlapAccumulator(["a", "b"], 4, settings=settings.model_copy(update={"centre": centre}))
        accumulator.update(components, torch.ones(1, 3, dtype=torch.bool))
        reports[centre] = accumulator.report().summary()
    report = reports[CENTRES[0]]
    assert report["coactivation_rate"] == 1.0 and report["projective_error"]["single_active"] is None
    assert report["projective_error"]["dominant_shift"] == pytest.approx(
        (ERROR_T0_APART + ERROR_T1 + ERROR_T2) / 3, abs=1e-6
    )
    assert report["projective_error"]["dominant_shift_fraction"] == 1.0
    assert report["pairs"]["a|b"]["top1_same_shift_share"] is None

    flat = flatten_report(reports)
    assert set(flat) | set(PROXY_OWNER_STATISTICS) | set(INTERFERENCE_STATISTICS) == set(diagnostic_names(settings))
    # No merge was measured: the merge's retention is undefined, the composition's is defined.
    assert flat["retention_kl_max_merge"] is None and flat["retention_kl_max_merge_minus_compose"] is None
    assert flat["retention_kept_min_compose"] is not None
    assert flat["projective_error"] is None
    assert flat["projective_error_dominant"] == pytest.approx((ERROR_T0_APART + ERROR_T1 + ERROR_T2) / 3, abs=1e-6)
    assert flat["top1_shift_rate_mean"] == pytest.approx(0.5) and flat["top1_shift_rate_max"] == pytest.approx(2 / 3)
    assert flat["top1_both_shift_rate_mean"] == flat["top1_both_shift_rate_max"] == 0.0
    assert flat["top1_same_shift_share_mean"] is None and flat["top1_same_shift_share_min"] is None
    assert flat["delta_norm_ratio_mean"] >= 1.0 and flat["delta_norm_ratio_max_median"] >= 1.0
    reasons = undefined_reasons(flat, reports, settings)
    assert "co-active" in reasons["projective_error"]
    assert "shift to the same token" in reasons["top1_same_shift_share_mean"]
    assert "projective_error_dominant" not in reasons
    check_rule_diagnostics(load_rule(), settings)  # the shipped rule still reads only measured diagnostics


def test_undefined_reasons_of_the_new_diagnostics():
    base, experts, _ = _case()
    components = torch.cat([base[None], base[None]])[:, None]  # one expert, equal to the base
    accumulator = OverlapAccumulator(["a"], 4)
    accumulator.update(components, torch.ones(1, 3, dtype=torch.bool))
    report = accumulator.report().summary()
    flat = flatten_report({centre: report for centre in CENTRES})
    assert flat["top1_shift_rate_mean"] == 0.0 and flat["projective_error_dominant"] is None
    reasons = undefined_reasons(flat, {centre: report for centre in CENTRES})
    assert "exactly one expert whose top-1 token differs" in reasons["projective_error_dominant"]
    for name in ("top1_both_shift_rate_mean", "top1_same_shift_share_min", "delta_norm_ratio_max"):
        assert "there is only 1 expert" in reasons[name]
    # Two experts, one equal to the base: its delta is 0, the ratio unbounded.
    accumulator = OverlapAccumulator(["a", "b"], 4, settings=OverlapSettings(full_vocabulary=True))
    accumulator.update(torch.cat([base[None], experts[:1], base[None]])[:, None], torch.ones(1, 3, dtype=torch.bool))
    report = accumulator.report().summary()
    assert report["pairs"]["a|b"]["delta_norm_ratio"] is None
    flat = flatten_report({centre: report for centre in CENTRES})
    assert "unbounded" in undefined_reasons(flat, {centre: report for centre in CENTRES})["delta_norm_ratio_mean"]


# ------------------------------------------------------------------------------------ models


def _expected(components: torch.Tensor) -> dict:
    """The new statistics from the pure functions on `(k+1, N, V)` log-probs, weights 1."""
    base, experts = components[0], components[1:]
    composed = compose_logprobs(base, list(experts))
    counts = sx.shift_counts(sx.top1_tokens(base, experts))
    agreement = sx.shift_agreement(counts)
    error, eligible = sx.dominant_shift_error(base, experts, composed)
    return {
        "rates": sx.top1_shift_rate(counts).tolist(),
        "both": float(agreement.both_shift_rate[0, 1]),
        "same": float(agreement.same_token_share[0, 1]),
        "dominant": float(error[eligible].double().mean()) if eligible.any() else None,
        "fraction": float(eligible.double().mean()),
    }


def _assert_report_matches(report: dict, expected: dict, names: list[str]) -> None:
    for name, rate in zip(names, expected["rates"]):
        assert report["experts"][name]["top1_shift_rate"] == pytest.approx(rate, rel=1e-12)
    pair = report["pairs"][f"{names[0]}|{names[1]}"]
    assert pair["top1_both_shift_rate"] == pytest.approx(expected["both"], rel=1e-12)
    if math.isnan(expected["same"]):
        assert pair["top1_same_shift_share"] is None
    else:
        assert pair["top1_same_shift_share"] == pytest.approx(expected["same"], rel=1e-12)
    assert pair["delta_norm_ratio"] >= 1.0
    assert report["projective_error"]["dominant_shift_fraction"] == pytest.approx(expected["fraction"], rel=1e-12)
    if expected["dominant"] is None:
        assert report["projective_error"]["dominant_shift"] is None
    else:
        assert report["projective_error"]["dominant_shift"] == pytest.approx(expected["dominant"], rel=1e-4)


def test_measure_overlap_on_random_full_experts(base_model, expert_models, batches):
    """Experts unrelated to the base: every position is co-active, the single-active error is undefined, the
    dominant-shift one is not."""
    report = measure_overlap(ComposedLM(base_model, expert_models), batches, progress=False).to_dict()
    batch = batches[0]
    real = batch["attention_mask"].bool()
    components = torch.stack(
        [model_logprobs(m, batch["input_ids"], batch["attention_mask"])[real] for m in [base_model, *expert_models]]
    )  # (k+1, N, V), each model run on its own
    expected = _expected(components)
    assert report["coactivation_rate"] == 1.0 and report["projective_error"]["single_active"] is None
    assert expected["dominant"] is not None
    _assert_report_matches(report, expected, ["expert_0", "expert_1"])


def test_measure_overlap_on_lora_experts(base_model, lora_dirs, batches):
    adapters = {name: str(path) for name, path in lora_dirs.items()}
    with ComposedLM.from_adapters(copy.deepcopy(base_model), adapters) as composed:
        report = measure_overlap(composed, batches, progress=False).to_dict()
        batch = batches[0]
        real = batch["attention_mask"].bool()
        components = composed.component_logprobs(batch["input_ids"], batch["attention_mask"])[:, real]
    expected = _expected(components)
    assert 0 < min(expected["rates"]) and max(expected["rates"]) < 1
    _assert_report_matches(report, expected, list(adapters))
