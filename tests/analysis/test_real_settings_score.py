"""A verdict rule scored on real settings against the best constant, and what `overlap --recommend` makes of it."""

from __future__ import annotations

import json
import math
from typing import get_args

import pytest
from scipy.stats import binomtest, norm

from mergecompose.analysis.overlap_report import recommendation_text
from mergecompose.analysis.paired_outcome import OUTCOMES
from mergecompose.analysis.predict import VERDICTS, Threshold, VerdictRule, load_rule, recommend
from mergecompose.analysis.real_settings_score import (
    VERDICT_LABELS,
    PairedLabel,
    score_on_real_settings,
)

SOURCE = "docs/results/data/settings_records.json v1"


def tiny_rule(**fields) -> VerdictRule:
    """Composition succeeds when a < 0.5, the merge when b < 0.5, the remedy when c < 0.5."""
    return VerdictRule(
        compose=Threshold(feature="a", threshold=0.5, direction="below"),
        merge=Threshold(feature="b", threshold=0.5, direction="below"),
        remedy=Threshold(feature="c", threshold=0.5, direction="below"),
        heldout_accuracy=0.5,
        n_settings=10,
        sweep={"name": "test", "version": 1},
        **fields,
    )


# (label, diagnostics): the tiny rule's verdict in the comment, and whether it is right.
SETTINGS = [
    ("compose", {"a": 0.1, "b": 0.9, "c": 0.9}),  # compose: right
    ("merge", {"a": 0.9, "b": 0.1, "c": 0.9}),  # merge: right
    ("compose", {"a": 0.1, "b": 0.1, "c": 0.9}),  # either: wrong
    ("compose", {"a": 0.9, "b": 0.9, "c": 0.1}),  # compose+gate, a composition: right
    ("neither", {"a": 0.9, "b": 0.9, "c": None}),  # undecided (compose+gate or neither): wrong
    ("neither", {"a": 0.9, "b": 0.9, "c": 0.9}),  # neither: right
    ("either", {"a": 0.1, "b": 0.9, "c": 0.9}),  # compose: wrong
]


def test_the_labels_and_the_verdict_mapping_agree_with_the_rule_and_the_paired_outcome():
    assert get_args(PairedLabel) == OUTCOMES == ("merge", "compose", "either", "neither")
    assert set(VERDICT_LABELS) == set(VERDICTS) and set(VERDICT_LABELS.values()) == set(OUTCOMES)
    assert VERDICT_LABELS["compose+gate"] == "compose"


def test_the_score_by_hand():
    score = score_on_real_settings(tiny_rule(), SETTINGS, SOURCE)
    assert [tiny_rule().verdict(d) for _, d in SETTINGS] == [
        "compose",
        "merge",
        "either",
        "compose+gate",
        "undecided",
        "neither",
        "compose",
    ]
    assert (score.n, score.correct, score.undecided, score.source) == (7, 4, 1, SOURCE)
    assert score.accuracy == pytest.approx(4 / 7, abs=1e-12)
    assert score.counts == {"merge": 1, "compose": 3, "either": 1, "neither": 2}
    assert score.base_rates == pytest.approx({"merge": 1 / 7, "compose": 3 / 7, "either": 1 / 7, "neither": 2 / 7})
    assert score.best_constant.label == "compose"
    assert score.best_constant.accuracy == pytest.approx(3 / 7, abs=1e-12)
    assert score.beats_best_constant()  # 4 right against 3


def wilson_by_hand(k: int, n: int) -> tuple[float, float]:
    """(p + z²/2n ± z √(p(1−p)/n + z²/4n²)) / (1 + z²/n), z the 97.5 % normal quantile."""
    z, p = norm.ppf(0.975), k / n
    centre = (p + z**2 / (2 * n)) / (1 + z**2 / n)
    half = z / (1 + z**2 / n) * math.sqrt(p * (1 - p) / n + z**2 / (4 * n**2))
    return centre - half, centre + half


def test_the_intervals_are_wilson():
    score = score_on_real_settings(tiny_rule(), SETTINGS, SOURCE)
    for (low, high), k in [(score.interval, 4), (score.best_constant.interval, 3)]:
        scipy_interval = binomtest(k, 7).proportion_ci(method="wilson")
        assert (low, high) == pytest.approx((scipy_interval.low, scipy_interval.high), abs=1e-12)
        assert (low, high) == pytest.approx(wilson_by_hand(k, 7), abs=1e-9)
        assert low < k / 7 < high


def test_undecided_counts_wrong_and_compose_gate_counts_as_compose():
    undecided = score_on_real_settings(tiny_rule(), [SETTINGS[4]], SOURCE)  # label neither
    assert (undecided.correct, undecided.undecided, undecided.accuracy) == (0, 1, 0.0)
    gated = SETTINGS[3][1]
    assert score_on_real_settings(tiny_rule(), [("compose", gated)], SOURCE).correct == 1
    assert score_on_real_settings(tiny_rule(), [("neither", gated)], SOURCE).correct == 0


@pytest.mark.parametrize(
    ("labels", "best"),
    [
        (["compose", "merge"], "merge"),  # a tie goes to the first in OUTCOMES
        (["neither", "either", "either", "neither"], "either"),
        (["neither", "neither", "merge"], "neither"),
    ],
)
def test_the_best_constant_and_its_ties(labels, best):
    score = score_on_real_settings(tiny_rule(), [(label, SETTINGS[0][1]) for label in labels], SOURCE)
    assert score.best_constant.label == best
    assert score.best_constant.accuracy == pytest.approx(labels.count(best) / len(labels), abs=1e-12)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="at least one"):
        score_on_real_settings(tiny_rule(), [], SOURCE)
    with pytest.raises(ValueError, match=r"`settings\[1\]` has label 'compose\+gate'"):
        score_on_real_settings(tiny_rule(), [SETTINGS[0], ("compose+gate", {})], SOURCE)


def test_a_rule_file_with_the_score_round_trips_and_an_old_one_loads(tmp_path):
    rule = tiny_rule(real_settings=score_on_real_settings(tiny_rule(), SETTINGS, SOURCE))
    path = tmp_path / "rule.json"
    path.write_text(rule.model_dump_json(indent=1))
    assert load_rule(path) == rule
    assert load_rule(path).real_settings.best_constant.label == "compose"
    old = tiny_rule().model_dump(mode="json")
    del old["real_settings"]  # a file written before the field existed
    path.write_text(json.dumps(old))
    assert load_rule(path).real_settings is None


def test_an_inconsistent_score_in_a_rule_file_is_refused(tmp_path):
    data = tiny_rule(real_settings=score_on_real_settings(tiny_rule(), SETTINGS, SOURCE)).model_dump(mode="json")
    data["real_settings"]["counts"]["merge"] = 5
    path = tmp_path / "rule.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"not a verdict rule: real_settings.*`counts` must sum to `n` = 7, got 11"):
        load_rule(path)


# ---------------------------------------------------------------------------------- recommend and its text

DIAGNOSTICS = {"a": 0.1, "b": 0.9, "c": 0.9}  # the tiny rule says "compose"


def measured(labels: list[str]) -> VerdictRule:
    """The tiny rule with its score on SETTINGS relabelled `labels`."""
    settings = [(label, diagnostics) for label, (_, diagnostics) in zip(labels, SETTINGS)]
    return tiny_rule(real_settings=score_on_real_settings(tiny_rule(), settings, SOURCE))


BEATS = [label for label, _ in SETTINGS]  # 4 right against "compose" 3
TIES = [*BEATS[:4], "compose", *BEATS[5:]]  # the undecided one relabelled: 4 right against "compose" 4, a tie


def test_recommend_decides_only_where_the_rule_beats_the_best_constant():
    decided = recommend(measured(BEATS), DIAGNOSTICS)
    assert decided["decision"] is True and decided["measured_on_real"] is True
    assert decided["real_settings"]["correct"] == 4 and decided["real_settings"]["best_constant"]["label"] == "compose"
    tied = recommend(measured(TIES), DIAGNOSTICS)
    assert tied["real_settings"]["counts"]["compose"] == tied["real_settings"]["correct"] == 4
    assert tied["decision"] is False and tied["measured_on_real"] is True
    unmeasured = recommend(tiny_rule(), DIAGNOSTICS)
    assert unmeasured["decision"] is False and unmeasured["measured_on_real"] is False
    assert unmeasured["real_settings"] is None
    for recommendation in (decided, tied, unmeasured):  # every key it had before stays
        assert recommendation["verdict"] == "compose" and recommendation["possible_verdicts"] == ["compose"]
        assert {"undefined", "evidence", "heldout_accuracy", "n_settings", "sweep", "caveat", "diagnostics"} <= set(
            recommendation
        )
    json.dumps(decided)  # it goes into overlap.json as it is


def test_the_text_of_a_decision():
    text = recommendation_text(recommend(measured(BEATS), DIAGNOSTICS)).splitlines()
    assert text[0] == "Recommendation: compose"
    figures = [line for line in text if line.startswith("  on real experts")]
    assert figures == [
        "  on real experts (held out from the rule): 57 % [25 %, 84 %] right over 7 settings (1 undecided); "
        "always answering 'compose': 43 % [16 %, 75 %]; "
        f"base rates: merge 14 %, compose 43 %, either 14 %, neither 29 % ({SOURCE})"
    ]
    assert not any("No recommendation" in line or "not a decision" in line for line in text)


def test_the_text_where_the_rule_does_not_beat_the_best_constant():
    text = recommendation_text(recommend(measured(TIES), DIAGNOSTICS)).splitlines()
    assert text[0] == (
        "No recommendation: on real experts these diagnostics do not predict merge or compose better than always "
        "answering 'compose' (rule 57 % [25 %, 84 %] vs 57 %, 7 settings); "
        "base rates: merge 14 %, compose 57 %, either 14 %, neither 14 %. "
        "Measure it: `mergecompose decide` (docs/guides/merge-or-compose.md)."
    )
    assert text[1] == "  what the rule would say (not a decision): compose"
    assert not any(line.startswith("Recommendation:") for line in text)
    assert any(line.startswith("  on real experts (held out from the rule): 57 %") for line in text)


def test_the_text_of_a_rule_not_measured_on_real_experts():
    text = recommendation_text(recommend(tiny_rule(), DIAGNOSTICS)).splitlines()
    assert text[0].startswith("No recommendation: this rule was not measured on real experts")
    assert text[1] == "  what the rule would say (not a decision): compose"
    assert "  not measured on real experts: the rule file has no figures on real settings" in text
    assert not any(line.startswith("Recommendation:") for line in text)
    # The evidence stays: each threshold against these diagnostics.
    assert "  compose: succeeds when a < 0.5; here a = 0.1 → yes" in text
