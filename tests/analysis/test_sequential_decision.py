"""The sequential rule: its capital by hand and against a scalar reference, its decisions on hand-made sequences,
and its error rates under nulls, simulated (2,000 runs each), within its bound α."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mergecompose.analysis.paired_outcome import paired_outcome
from mergecompose.analysis.sequential_decision import (
    BettingConfidenceSequence,
    DecisionSettings,
    SequentialDecision,
    decide_sequence,
    replay_orders,
)


def reference_log_capital(xs: list[float], m: float, alpha: float, c: float = 0.75) -> float:
    """The hedged capital log K_t(m) of the module docstring, one scalar at a time in plain Python."""
    plus = minus = 1.0
    total = squares = 0.0
    for t, x in enumerate(xs, start=1):
        variance = (0.25 + squares) / t
        bet = math.sqrt(2 * math.log(2 / alpha) / (variance * t * math.log(1 + t)))
        lam_plus = bet if m == 0 else min(bet, c / m)
        lam_minus = bet if m == 1 else min(bet, c / (1 - m))
        plus *= 1 + lam_plus * (x - m)
        minus *= 1 - lam_minus * (x - m)
        total += x
        squares += (x - (0.5 + total) / (t + 1)) ** 2
    return math.log(0.5 * plus + 0.5 * minus)


def test_the_first_bet_by_hand():
    """One x = 1 at m = 0.5, α = 0.05: λ̃ = sqrt(2 ln 40 / (¼ · 1 · ln 2)) ≈ 6.53 is capped at c/m = 1.5 both ways,
    so K⁺ = 1 + 1.5 · ½ = 1.75, K⁻ = 1 − 1.5 · ½ = 0.25, and K = ½ (1.75 + 0.25) = 1: no evidence yet."""
    sequence = BettingConfidenceSequence(0.05, grid_points=5)  # grid 0, ¼, ½, ¾, 1
    sequence.update(np.array([1.0]))
    assert sequence.log_capital[0, 2] == pytest.approx(0.0, abs=1e-12)
    # At m = ¼: λ⁺ = min(6.53, 3) = 3, λ⁻ = min(6.53, 1) = 1: K = ½ (1 + 3 · ¾) + ½ (1 − ¾) = 1.75.
    assert math.exp(sequence.log_capital[0, 1]) == pytest.approx(1.75, rel=1e-12)


@pytest.mark.parametrize("xs", [[1, 0, 1, 1, 0.5, 0, 1, 1], [0] * 30, [0.5] * 12 + [1] * 5])
def test_capital_matches_the_scalar_reference(xs):
    sequence = BettingConfidenceSequence(0.05, grid_points=21)
    for x in xs:
        sequence.update(np.array([float(x)]))
    for index, m in enumerate(sequence.grid):
        assert sequence.log_capital[0, index] == pytest.approx(reference_log_capital(xs, m, 0.05), rel=1e-9, abs=1e-9)


def test_bounds_are_the_surviving_grid_widened_and_intersected_over_time():
    sequence = BettingConfidenceSequence(0.05, grid_points=41)
    history = []
    for x in [0.0] * 40:
        sequence.update(np.array([x]))
        history.append((sequence.lower[0], sequence.upper[0]))
        surviving = sequence.grid[sequence.alive[0]]
        assert sequence.lower[0] <= max(surviving.min() - sequence.step, 0.0) + 1e-12
        assert sequence.upper[0] == pytest.approx(min(surviving.max() + sequence.step, 1.0))
    uppers = [upper for _, upper in history]
    assert all(later <= earlier for earlier, later in zip(uppers, uppers[1:]))
    assert uppers[-1] < 0.2  # forty zeros: the mean is small
    assert history[-1][0] == 0.0


def test_compose_always_right_is_compose_and_the_mirror_is_merge():
    compose = decide_sequence([False] * 100, [True] * 100)
    merge = decide_sequence([True] * 100, [False] * 100)
    assert (compose.label, merge.label) == ("compose", "merge")
    assert compose.items == merge.items < 20 and not compose.budget_reached
    assert compose.difference_interval == pytest.approx(tuple(-v for v in reversed(merge.difference_interval)))
    assert compose.merge_interval == merge.compose_interval


def test_both_always_right_is_either_and_both_always_wrong_is_neither():
    either = decide_sequence([True] * 300, [True] * 300)
    neither = decide_sequence([False] * 300, [False] * 300)
    assert (either.label, neither.label) == ("either", "neither")
    assert (
        either.merge_interval[0] >= 0.1
        and -0.1 < either.difference_interval[0] <= 0 <= either.difference_interval[1] < 0.1
    )
    assert neither.merge_interval[1] < 0.1 and neither.compose_interval[1] < 0.1
    assert neither.items < 100


def test_a_significant_winner_below_the_floor_is_not_called():
    """5 % against 0 %: the composition is better, but neither works; the rule never calls "compose" (it says
    "neither" once the composition's upper bound is below the floor, or at the budget by the fixed-n label)."""
    compose = ([True] + [False] * 19) * 20
    decision = decide_sequence([False] * 400, compose)
    assert decision.label == "neither"
    assert decision.difference_interval[0] > 0  # the difference alone would have said "compose"


def test_the_budget_gives_the_fixed_n_label_on_the_items_used():
    merge = [True, False, True, True, False, True, False, True] * 5
    compose = [True, True, False, True, False, True, True, False] * 5
    decision = decide_sequence(merge, compose, DecisionSettings(max_items=12))
    assert decision.budget_reached and decision.items == 12
    assert decision.label == paired_outcome(merge[:12], compose[:12]).label
    assert (decision.merge_right, decision.compose_right) == (sum(merge[:12]), sum(compose[:12]))


def test_replay_runs_each_order_as_decide_sequence_would():
    rng = np.random.default_rng(3)
    merge, compose = (rng.random(120) < 0.4).tolist(), (rng.random(120) < 0.7).tolist()
    decisions = replay_orders(merge, compose, orders=4, seed=11)
    permutations = np.random.default_rng(11)
    for decision in decisions:
        order = permutations.permutation(120)
        alone = decide_sequence([merge[i] for i in order], [compose[i] for i in order])
        assert decision == alone


@pytest.mark.parametrize(
    ("field", "value"), [("alpha", 0.0), ("alpha", 0.5), ("delta", 0.0), ("floor", 1.0), ("max_items", 0)]
)
def test_bad_settings_are_named(field, value):
    with pytest.raises(ValueError, match=f"`{field}` must be"):
        DecisionSettings(**{field: value})


def test_unequal_sequences_are_refused():
    with pytest.raises(ValueError, match="same items"):
        decide_sequence([True], [True, False])


# --- error rates under the null, simulated --------------------------------------------------------------------

RUNS, ITEMS, GRID = 2000, 150, 101


def simulate(probabilities: dict[str, float], seed: int) -> list[str]:
    """RUNS sequences of ITEMS paired items drawn from (both, merge only, compose only, neither right) shares;
    the labels of the sequences the rule stops before the budget (a budget label is not the sequential bound's)."""
    rng = np.random.default_rng(seed)
    kinds = rng.choice(4, size=(RUNS, ITEMS), p=list(probabilities.values()))  # (R, n)
    merge, compose = np.isin(kinds, (0, 1)), np.isin(kinds, (0, 2))
    rule = SequentialDecision(DecisionSettings(), batch=RUNS, grid_points=GRID)
    for item in range(ITEMS):
        rule.update(merge[:, item], compose[:, item])
    return [label for label in rule.labels if label is not None]


def test_equal_accuracies_are_rarely_called_merge_or_compose():
    """Both at 45 %, 30 % of items discordant: a "merge" or "compose" stop is an error."""
    labels = simulate({"both": 0.3, "merge": 0.15, "compose": 0.15, "neither": 0.4}, seed=0)
    wrong = sum(label in ("merge", "compose") for label in labels) / RUNS
    print(f"equal accuracies: wrong merge/compose stops {wrong:.4f} of {RUNS} runs (α = 0.05)")
    assert wrong <= 0.05


def test_accuracies_just_above_the_floor_are_rarely_called_neither():
    """Merge 12 %, composition 11 %: "neither" is an error."""
    labels = simulate({"both": 0.06, "merge": 0.06, "compose": 0.05, "neither": 0.83}, seed=1)
    wrong = sum(label == "neither" for label in labels) / RUNS
    print(f"accuracies 12 % and 11 %: wrong neither stops {wrong:.4f}")
    assert wrong <= 0.05


def test_a_difference_beyond_delta_is_rarely_called_either_or_the_wrong_side():
    """Composition 15 points better (merge 50 %, composition 65 %): "either" and "merge" are errors."""
    labels = simulate({"both": 0.45, "merge": 0.05, "compose": 0.2, "neither": 0.3}, seed=2)
    wrong = sum(label in ("either", "merge") for label in labels) / RUNS
    print(f"a 15-point difference: wrong either/merge stops {wrong:.4f}; compose {labels.count('compose') / RUNS:.3f}")
    assert wrong <= 0.05
    assert labels.count("compose") > RUNS / 2


def test_the_confidence_sequence_covers_the_mean_at_every_step():
    rng = np.random.default_rng(4)
    xs = (rng.random((RUNS, ITEMS)) < 0.3).astype(float)
    sequence = BettingConfidenceSequence(0.05, batch=RUNS, grid_points=GRID)
    missed = np.zeros(RUNS, dtype=bool)
    for item in range(ITEMS):
        sequence.update(xs[:, item])
        missed |= (sequence.lower > 0.3) | (sequence.upper < 0.3)
    print(f"Bernoulli(0.3): the running interval ever missed 0.3 in {missed.mean():.4f} of runs")
    assert missed.mean() <= 0.05


def test_the_thresholds_are_grid_points_compared_exactly():
    """A bound exactly at Δ = 0, at the floor or at ±δ is on the grid: 0 is not above 0 (no float at 2.2e-16
    decides), 10 % reaches the floor, −δ is not inside (−δ, δ)."""
    rule = SequentialDecision(DecisionSettings(), batch=1)  # 401 points: Δ = 0 is index 200, the floor 40, δ ±40
    rule.merge.lower_index[:], rule.merge.upper_index[:] = 0, 400
    rule.compose.lower_index[:], rule.compose.upper_index[:] = 40, 400
    rule.difference.lower_index[:], rule.difference.upper_index[:] = 200, 400
    assert rule._stops()[0] == ""  # Δ ≥ 0 only: not "compose"
    rule.difference.lower_index[:] = 201
    assert rule._stops()[0] == "compose"  # Δ > 0, and the composition's 10 % reaches the floor
    rule.compose.lower_index[:] = 39
    assert rule._stops()[0] == ""
    rule.merge.lower_index[:], rule.compose.lower_index[:] = 40, 40
    rule.difference.lower_index[:], rule.difference.upper_index[:] = 180, 219  # Δ in [−0.1, 0.095]
    assert rule._stops()[0] == ""
    rule.difference.lower_index[:] = 181
    assert rule._stops()[0] == "either"
    assert rule.difference.difference_bounds(0) == (-0.095, 0.095)
