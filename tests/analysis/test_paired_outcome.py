"""The outcome label: the exact McNemar test on the discordant items, by hand."""

from __future__ import annotations

import math

import pytest

from mergecompose.analysis.paired_outcome import paired_outcome


def exact_mcnemar(merge_only: int, compose_only: int) -> float:
    """Two-sided exact p-value by hand: twice the smaller binomial tail of d fair coin flips, at most 1."""
    d = merge_only + compose_only
    if d == 0:
        return 1.0
    tail = sum(math.comb(d, i) for i in range(min(merge_only, compose_only) + 1)) / 2**d
    return min(1.0, 2 * tail)


def items(both: int, merge_only: int, compose_only: int, neither: int) -> tuple[list[bool], list[bool]]:
    merge = [True] * both + [True] * merge_only + [False] * compose_only + [False] * neither
    compose = [True] * both + [False] * merge_only + [True] * compose_only + [False] * neither
    return merge, compose


@pytest.mark.parametrize(
    ("both", "merge_only", "compose_only", "neither", "label"),
    [
        (100, 0, 10, 90, "compose"),  # p = 2 / 2^10 = 0.00195
        (100, 10, 0, 90, "merge"),
        (100, 5, 5, 90, "either"),
        (100, 2, 8, 90, "either"),  # p = 2 · 56 / 1024 = 0.109
        (100, 1, 9, 90, "compose"),  # p = 2 · 11 / 1024 = 0.0215
        (100, 0, 0, 100, "either"),  # no discordant item: p = 1
        (0, 0, 19, 181, "neither"),  # p = 2 / 2^19, but the composition's 9.5 % is below the 10 % floor
        (0, 0, 20, 180, "compose"),  # 10 % reaches the floor: the test decides
        (19, 0, 1, 180, "either"),  # merge 9.5 %, composition 10 %: one reaches the floor, no difference
        (0, 0, 0, 50, "neither"),  # both 0 %
        (0, 6, 0, 0, "merge"),  # p = 2 / 64 = 0.03125
        (0, 5, 0, 0, "either"),  # p = 2 / 32 = 0.0625: five items cannot decide at α = 0.05
    ],
)
def test_labels_and_p_values_by_hand(both, merge_only, compose_only, neither, label):
    merge, compose = items(both, merge_only, compose_only, neither)
    outcome = paired_outcome(merge, compose)
    assert outcome.label == label
    assert outcome.p_value == pytest.approx(exact_mcnemar(merge_only, compose_only), rel=1e-12)
    assert (outcome.merge_only, outcome.compose_only) == (merge_only, compose_only)
    assert (outcome.merge_right, outcome.compose_right) == (both + merge_only, both + compose_only)
    assert outcome.items == both + merge_only + compose_only + neither


def test_only_the_discordant_items_count():
    """Items both get right, or both wrong, do not move the label: accuracy 60 % vs 50 % on 20 items is 'either'."""
    merge, compose = items(10, 2, 0, 8)
    assert paired_outcome(merge, compose).label == "either"
    many_merge, many_compose = items(1000, 2, 0, 8)
    assert paired_outcome(many_merge, many_compose).p_value == paired_outcome(merge, compose).p_value


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="same items"):
        paired_outcome([True], [True, False])
    with pytest.raises(ValueError, match="same items"):
        paired_outcome([], [])
    with pytest.raises(ValueError, match="`merge_right` must be a sequence of bools"):
        paired_outcome([1, 0], [True, False])
    with pytest.raises(ValueError, match="`alpha` must be in"):
        paired_outcome([True], [False], alpha=1.5)
    with pytest.raises(ValueError, match="`floor` must be in"):
        paired_outcome([True], [False], floor=-0.1)
