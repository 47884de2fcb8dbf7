"""The paired verdict: its rule, held-out scoring without leaks, the baselines, the accuracy interval, the command."""

from __future__ import annotations

import json
import math

import pytest

from mergecompose.cli import main
from mergecompose.studies.predict import paired_verdict
from mergecompose.studies.predict.paired_verdict import (
    UNDECIDED,
    LabelledSetting,
    PairedRule,
    accuracy,
    evaluate,
    fit_paired_rule,
    heldout_predictions,
    majority_label,
    real_settings,
    synthetic_settings,
    training_settings,
)


def setting(name, experts, label, x, y=0.0, source="real"):
    return LabelledSetting(name, source, frozenset(experts), label, 0.0, {"x": x, "y": y, "constant": 1.0})


# Six real settings over four experts; `x` separates compose (high) from merge (low), either in between.
SETTINGS = [
    setting("a+b", {"a", "b"}, "compose", 0.9),
    setting("c+d", {"c", "d"}, "compose", 0.8),
    setting("a+c", {"a", "c"}, "merge", 0.1),
    setting("b+d", {"b", "d"}, "merge", 0.2),
    setting("a+d", {"a", "d"}, "either", 0.5),
    setting("b+c", {"b", "c"}, "either", 0.45),
]


def test_the_rule_separates_the_labels_on_the_feature_that_does():
    rule = fit_paired_rule(SETTINGS)
    assert rule.compose.feature == "x" and rule.compose.direction == "above"
    assert 0.5 < rule.compose.threshold < 0.8  # the midpoint between 0.5 and 0.8
    assert rule.merge.feature == "x" and rule.merge.direction == "below"
    assert 0.2 < rule.merge.threshold < 0.45
    assert [rule.verdict(s.diagnostics) for s in SETTINGS] == [s.label for s in SETTINGS]
    assert rule.verdict({"x": None}) == UNDECIDED  # the diagnostic it reads is undefined here
    assert rule.verdict({}) == UNDECIDED


def test_two_yeses_are_undecided():
    yes = {"feature": "x", "threshold": 0.0, "direction": "above"}
    rule = PairedRule.model_validate({"compose": yes, "merge": yes, "n_settings": 2})
    assert rule.verdict({"x": 1.0}) == UNDECIDED


def test_no_setting_is_scored_by_a_rule_fitted_on_a_setting_that_shares_an_expert():
    seen = {}

    def recording_fit(train):
        seen.setdefault("calls", []).append([s.name for s in train])
        return fit_paired_rule(train)

    rows = heldout_predictions(SETTINGS, fit=recording_fit)
    assert len(seen["calls"]) == len(SETTINGS)
    for scored, fitted_on in zip(SETTINGS, seen["calls"]):
        assert scored.name not in fitted_on
        shared = {s.name for s in SETTINGS if s.experts & scored.experts}
        assert not shared & set(fitted_on), (scored.name, fitted_on)
    # a+b shares an expert with every setting but c+d: its rule is fitted on c+d alone.
    assert seen["calls"][0] == ["c+d"] and rows[0]["fitted_on"] == 1


def test_a_leaking_split_is_refused(monkeypatch):
    """If the training split ever included the scored setting (or one sharing its experts), scoring stops."""
    monkeypatch.setattr(paired_verdict, "training_settings", lambda scored, settings: list(settings))
    with pytest.raises(AssertionError, match="fitted on a setting sharing its experts"):
        heldout_predictions(SETTINGS)


def test_synthetic_settings_are_held_out_by_family():
    family_a = [setting(f"a{i}", {"synthetic:A"}, "either", i, source="synthetic") for i in range(3)]
    family_b = [setting(f"b{i}", {"synthetic:B"}, "merge", i, source="synthetic") for i in range(2)]
    assert training_settings(family_a[0], family_a + family_b) == family_b
    rows = heldout_predictions(family_a + family_b)
    # Each family is scored by a rule fitted on the other, whose labels are all one: a constant rule.
    assert [row["predicted"] for row in rows] == ["merge"] * 3 + ["either"] * 2
    assert [row["baselines"]["majority"] for row in rows] == ["merge"] * 3 + ["either"] * 2


def test_a_setting_with_nothing_to_fit_on_is_undecided():
    rows = heldout_predictions([setting("a+b", {"a", "b"}, "merge", 0.1), setting("b+c", {"b", "c"}, "merge", 0.2)])
    assert [row["predicted"] for row in rows] == [UNDECIDED, UNDECIDED]
    assert evaluate(rows)["rule"]["accuracy"] == 0.0  # undecided counts as wrong


def test_majority_label_and_its_ties():
    assert majority_label([setting("1", {"a"}, "either", 0), setting("2", {"b"}, "compose", 0)]) == "compose"
    assert majority_label([setting("1", {"a"}, "either", 0), setting("2", {"b"}, "merge", 0)]) == "merge"
    assert majority_label([setting(str(i), {str(i)}, "either", 0) for i in range(3)]) == "either"


def test_accuracy_interval_is_wilson_s():
    hits = [True] * 7 + [False] * 3
    result = accuracy(hits)
    z = 1.959963984540054
    n, p = 10, 0.7
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert result["accuracy"] == 0.7 and result["correct"] == 7 and result["n"] == 10
    assert result["ci95"] == pytest.approx([centre - half, centre + half], rel=1e-9)
    assert accuracy([]) == {"accuracy": None, "ci95": None, "correct": 0, "n": 0}


def test_evaluate_counts_the_confusion_and_the_baselines():
    rows = [
        {
            "label": "compose",
            "predicted": "compose",
            "baselines": {"always merge": "merge", "always compose": "compose", "majority": "either"},
        },
        {
            "label": "merge",
            "predicted": UNDECIDED,
            "baselines": {"always merge": "merge", "always compose": "compose", "majority": "merge"},
        },
        {
            "label": "either",
            "predicted": "merge",
            "baselines": {"always merge": "merge", "always compose": "compose", "majority": "either"},
        },
    ]
    report = evaluate(rows)
    assert report["rule"]["correct"] == 1 and report["undecided"] == 1
    assert report["confusion"]["merge"][UNDECIDED] == 1 and report["confusion"]["either"]["merge"] == 1
    assert {name: b["correct"] for name, b in report["baselines"].items()} == {
        "always merge": 1,
        "always compose": 1,
        "majority": 2,
    }
    assert report["beats_every_baseline"] is False


def _predict_json(labels):
    records = []
    for index, (family, label) in enumerate(labels):
        merge = [True, False, True, True]
        compose = [True, True, False, index % 2 == 0]
        records.append(
            {
                "name": f"s{index}",
                "family": family,
                "diagnostics": {"x": 10.0 + index, "y": 1.0 if label == "merge" else 0.0},
                "paired": {"label": label, "merge_rights": merge, "compose_rights": compose},
            }
        )
    return {"settings": records}


def _results_json():
    def record(name, skills, label, x):
        return {
            "name": name,
            "skills": skills,
            "outcome": {"label": label},
            "chosen": {"merge": {"system": "m"}, "compose": {"system": "c"}},
            "test": {"m": {"accuracy": 0.25}, "c": {"accuracy": 0.75}},
            "compose_minus_merge": 0.5,
            "diagnostics": {"x": x, "y": 0.0},
        }

    return {
        "base": "smollm2",
        "settings": [record("u+j", ["u", "j"], "either", 0.3), record("d+b", ["d", "b"], "compose", 0.9)],
    }


def test_reading_the_sweeps_results():
    synthetic = synthetic_settings(_predict_json([("F", "merge"), ("G", "either")]))
    assert [s.experts for s in synthetic] == [frozenset({"synthetic:F"}), frozenset({"synthetic:G"})]
    assert synthetic[0].gap == pytest.approx(0.75 - 0.75) and synthetic[1].gap == pytest.approx(0.5 - 0.75)
    real = real_settings(_results_json())
    assert [s.name for s in real] == ["smollm2/u+j", "smollm2/d+b"]
    assert real[0].experts == frozenset({"smollm2:u", "smollm2:j"}) and real[0].gap == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no `base`"):
        real_settings({"settings": []})


def test_fit_verdict_command_writes_its_outputs(tmp_path, capsys):
    predict, real = tmp_path / "predict", tmp_path / "real"
    predict.mkdir()
    real.mkdir()
    labels = [("F", "merge"), ("F", "either"), ("G", "merge"), ("G", "either"), ("H", "either"), ("H", "merge")]
    (predict / "predict.json").write_text(json.dumps(_predict_json(labels)))
    (real / "results.json").write_text(json.dumps(_results_json()))
    out = tmp_path / "out"
    assert main(["fit-verdict", "--predict", str(predict), "--real", str(real), "--out", str(out), "--quiet"]) == 0
    results = json.loads((out / "verdict.json").read_text())
    assert results["n_settings"] == 8 and results["n_real"] == 2
    # `y` marks every synthetic "merge": each family's rule, fitted on the other two, finds it.
    synthetic_rows = [row for row in results["rows"] if row["source"] == "synthetic"]
    assert [row["predicted"] for row in synthetic_rows] == [row["label"] for row in synthetic_rows]
    assert results["heldout"]["all"]["rule"]["n"] == 8 and results["heldout"]["real"]["rule"]["n"] == 2
    assert PairedRule.model_validate(json.loads((out / "paired_rule.json").read_text())).n_settings == 8
    assert (out / "diagnostics_vs_gap.png").stat().st_size > 0
    assert "## Real settings" in (out / "verdict.md").read_text()
    printed = capsys.readouterr().out
    assert "real settings, held out (n = 2)" in printed and "all settings, held out (n = 8)" in printed
