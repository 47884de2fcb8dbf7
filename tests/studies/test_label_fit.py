"""The four-label rule: its tree read as scikit-learn reads it, fitted on one or two diagnostics, scored held out
without leaks against the four constants and the majority label; what tracks what per kind; `fit-rule`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError
from scipy.stats import spearmanr

from mergecompose.analysis.label_rule import Cut, LabelRule, Leaf
from mergecompose.analysis.paired_outcome import OUTCOMES, paired_outcome
from mergecompose.cli import main
from mergecompose.studies.predict.label_fit import (
    evaluate,
    fit_label_rule,
    heldout_rows,
    majority,
    refit,
    setting_kind,
    tracking,
    training_settings,
    tree_rule,
)
from mergecompose.studies.predict.records import (
    ChosenSystems,
    Made,
    SettingRecord,
    SettingsRecords,
    SweepSource,
    SystemRecord,
    rights_string,
    write_records,
)
from mergecompose.studies.skill_pairs.skill_data import pair_kind

N = 40
# Test rights that give each label: the merge right everywhere and the composition nowhere is "merge", and so on.
RIGHTS = {
    "merge": ([True] * N, [False] * N),
    "compose": ([False] * N, [True] * N),
    "either": ([True] * N, [True] * N),
    "neither": ([False] * N, [False] * N),
}


def setting(name, label, diagnostics, skills=None, source="real", compose_right=None) -> SettingRecord:
    merge, compose = RIGHTS[label]
    if compose_right is not None:  # a composition right on the first `compose_right` items, the merge on none
        merge, compose = [False] * N, [i < compose_right for i in range(N)]
    assert paired_outcome(merge, compose).label == label
    skills = skills or (f"{name}-a", f"{name}-b")
    return SettingRecord(
        name=name,
        source=source,
        base="b" if source == "real" else f"synthetic:{name}",
        family=None if source == "real" else name,
        experts=[f"b:{skill}" for skill in skills] if source == "real" else [f"synthetic:{name}"],
        diagnostics=diagnostics,
        chosen=ChosenSystems(merge="m", compose="c"),
        systems={"m": SystemRecord(test=rights_string(merge)), "c": SystemRecord(test=rights_string(compose))},
        label=label,
        sweep="s",
        config_hash="h",
    )


def test_a_rule_walks_its_cuts_and_falls_back_where_a_diagnostic_is_undefined():
    rule = LabelRule(
        root=Cut(
            feature="x",
            threshold=0.5,
            below=Leaf(label="merge"),
            above=Cut(feature="y", threshold=2.0, below=Leaf(label="either"), above=Leaf(label="compose")),
        ),
        fallback="neither",
        n_settings=3,
        training_accuracy=1.0,
    )
    assert rule.verdict({"x": 0.5}) == "merge"  # <= goes below, as scikit-learn's trees
    assert rule.verdict({"x": 0.6, "y": 2.0}) == "either"
    assert rule.verdict({"x": 0.6, "y": 2.1}) == "compose"
    assert rule.verdict({"x": 0.6, "y": None}) == "neither"
    assert rule.verdict({"x": float("nan")}) == "neither"
    assert rule.verdict({}) == "neither"
    assert rule.verdict({"x": 0.1}) == "merge"  # y is not read on the way to a leaf
    assert rule.features() == ["x", "y"]
    assert rule.describe() == "x <= 0.5 ? merge : (y <= 2 ? either : compose); where undefined: neither"
    assert LabelRule.model_validate(json.loads(rule.model_dump_json())) == rule


def test_a_rule_reads_at_most_two_diagnostics():
    three = Cut(
        feature="x",
        threshold=0,
        below=Cut(feature="y", threshold=0, below=Leaf(label="merge"), above=Leaf(label="either")),
        above=Cut(feature="z", threshold=0, below=Leaf(label="compose"), above=Leaf(label="neither")),
    )
    with pytest.raises(ValidationError, match=r"at most 2 diagnostics at depth at most 2, got \['x', 'y', 'z'\]"):
        LabelRule(root=three, fallback="merge", n_settings=1, training_accuracy=1)
    deep = Cut(
        feature="x",
        threshold=0,
        below=Leaf(label="merge"),
        above=Cut(
            feature="y",
            threshold=0,
            below=Leaf(label="merge"),
            above=Cut(feature="x", threshold=1, below=Leaf(label="either"), above=Leaf(label="neither")),
        ),
    )
    with pytest.raises(ValidationError, match="at depth 3"):
        LabelRule(root=deep, fallback="merge", n_settings=1, training_accuracy=1)


def test_the_written_out_tree_answers_as_scikit_learn_does():
    rng = np.random.default_rng(0)
    labels = list(OUTCOMES)
    settings = [
        setting(f"s{i}", labels[int(rng.integers(4))], {"x": float(rng.normal()), "y": float(rng.normal())})
        for i in range(30)
    ]
    rule, tree = tree_rule(settings, ["x", "y"])
    probes = rng.normal(size=(200, 2))
    assert [rule.verdict({"x": a, "y": b}) for a, b in probes] == list(tree.predict(probes))
    assert rule.training_accuracy == pytest.approx(
        np.mean(
            tree.predict(np.array([[s.diagnostics["x"], s.diagnostics["y"]] for s in settings]))
            == [s.label for s in settings]
        )
    )


def test_the_fit_finds_the_diagnostic_that_separates_the_labels_and_prefers_one_to_two():
    # x separates merge (x < 0) from compose (x > 0); noise does not; constant and partly undefined ones are unusable.
    values = [-3, -2, -1, 1, 2, 3]
    settings = [
        setting(
            f"s{i}",
            "merge" if x < 0 else "compose",
            {"noise": float((i * 7) % 5), "x": float(x), "same": 1.0, "gap": None if i == 0 else 1.0 * i},
        )
        for i, x in enumerate(values)
    ]
    rule = fit_label_rule(settings)
    assert rule.features() == ["x"] and rule.training_accuracy == 1.0
    assert [rule.verdict(s.diagnostics) for s in settings] == [s.label for s in settings]
    assert rule.fallback == "merge"  # three each: ties go to the first label


def test_with_no_usable_diagnostic_the_rule_is_the_majority_label():
    settings = [setting("a", "compose", {"x": 1.0}), setting("b", "compose", {"x": 1.0}), setting("c", "either", {})]
    rule = fit_label_rule(settings)
    assert rule.root == Leaf(label="compose") and rule.fallback == "compose"
    assert rule.training_accuracy == pytest.approx(2 / 3)
    assert majority(["either", "neither", "either", "neither"]) == "either"


def test_heldout_rows_never_fit_on_a_setting_that_shares_an_expert():
    # b and c share the skill q; d is synthetic; every real setting is scored by the others that share nothing.
    a = setting("a", "merge", {"x": 0.0}, skills=("p", "r"))
    b = setting("b", "compose", {"x": 1.0}, skills=("p", "q"))
    c = setting("c", "compose", {"x": 2.0}, skills=("q", "s"))
    d = setting("d", "merge", {"x": -1.0}, source="synthetic")
    settings = [a, b, c, d]
    assert [s.name for s in training_settings(b, settings, "all")] == ["d"]
    assert [s.name for s in training_settings(c, settings, "all")] == ["a", "d"]
    assert [s.name for s in training_settings(c, settings, "real")] == ["a"]
    rows = {row["name"]: row for row in heldout_rows(settings, "all")}
    assert set(rows) == {"a", "b", "c"}  # synthetic settings are fitted on, never scored
    assert rows["b"]["fitted_on"] == 1 and rows["b"]["predicted"] == "merge"  # d alone: a majority leaf
    assert rows["c"]["baselines"]["majority"] == "merge"
    assert rows["c"]["predicted"] == "merge"  # a and d are both merge: nothing to cut
    real_only = {row["name"] for row in heldout_rows(settings, "real")}
    assert real_only == {"a", "c"}  # b shares p with a and q with c: no real setting is left to fit it on
    alone = [
        setting("e", "merge", {"x": 0.0}, skills=("p", "q")),
        setting("f", "compose", {"x": 1.0}, skills=("q", "z")),
    ]
    assert heldout_rows(alone, "real") == []  # nothing left to fit on: not scored


def test_evaluate_counts_against_each_constant_and_the_target():
    rows = [
        {"label": label, "predicted": predicted, "baselines": {**{f"always {o}": o for o in OUTCOMES}, "majority": m}}
        for label, predicted, m in [
            ("merge", "merge", "compose"),
            ("merge", "merge", "compose"),
            ("compose", "compose", "compose"),
            ("compose", "compose", "compose"),
            ("either", "compose", "compose"),
        ]
    ]
    report = evaluate(rows)
    assert report["rule"]["correct"] == 4 and report["rule"]["accuracy"] == pytest.approx(0.8)
    assert report["baselines"]["always merge"]["correct"] == 2
    assert report["baselines"]["always neither"]["correct"] == 0
    assert report["baselines"]["majority"]["correct"] == 2
    assert report["best_baseline"] == "always merge"  # ties go to the first
    assert report["margin"] == pytest.approx(0.4)
    assert report["beats_every_baseline"] and report["meets_target"]
    assert report["confusion"]["either"]["compose"] == 1
    short = evaluate(rows[:3])  # right on all three; always merge on two: 33 points behind
    assert short["margin"] == pytest.approx(1 / 3) and short["meets_target"]
    behind = evaluate([dict(row, predicted="neither") for row in rows])
    assert behind["rule"]["correct"] == 0 and not behind["beats_every_baseline"] and not behind["meets_target"]


def test_pair_kinds():
    assert pair_kind("units", "dates") == "content × content"
    assert pair_kind("units", "json") == "content × format"
    assert pair_kind("dates", "signature") == "content × format"
    assert pair_kind("capitals", "signature") == "style × style"
    assert pair_kind("opening", "one_sentence") == "style × style"
    assert pair_kind("sort", "opening") == "content × style"
    with pytest.raises(ValueError, match="'poetry' is none of the skills"):
        pair_kind("units", "poetry")


def test_tracking_is_spearman_per_kind_against_the_lead_and_the_merge_winning():
    settings = [
        setting("u1", "compose", {"x": 0.1, "y": 5.0}, skills=("units", "json"), compose_right=30),
        setting("u2", "compose", {"x": 0.3, "y": 4.0}, skills=("dates", "json"), compose_right=20),
        setting("u3", "compose", {"x": 0.2, "y": 1.0}, skills=("sort", "brackets"), compose_right=25),
        setting("u4", "merge", {"x": 0.9, "y": 2.0}, skills=("units", "signature")),
        setting("s1", "merge", {"x": 0.5, "y": None}, skills=("capitals", "opening")),
        setting("z", "merge", {"x": 0.0}, source="synthetic"),
    ]
    assert setting_kind(settings[0]) == "content × format" and setting_kind(settings[4]) == "style × style"
    assert setting_kind(setting("o", "merge", {}, skills=("units", "poetry"))) == "other"
    report = tracking(settings, min_settings=4)
    assert set(report) == {"all real", "content × format", "style × style"}
    assert report["all real"]["n"] == 5 and report["style × style"]["diagnostics"] == {}  # one setting
    x = [0.1, 0.3, 0.2, 0.9]
    lead = [30 / N, 20 / N, 25 / N, -1.0]
    entry = report["content × format"]["diagnostics"]["x"]
    assert entry["compose_lead"]["rho"] == pytest.approx(spearmanr(x, lead).statistic)
    assert entry["merge_wins"]["rho"] == pytest.approx(spearmanr(x, [0, 0, 0, 1]).statistic)
    low, high = entry["compose_lead"]["ci95"]
    assert -1 <= low <= entry["compose_lead"]["rho"] <= high <= 1
    y = report["all real"]["diagnostics"]["y"]  # undefined on s1: the four others
    assert y["compose_lead"]["rho"] == pytest.approx(spearmanr([5.0, 4.0, 1.0, 2.0], lead).statistic)
    assert y["compose_lead"]["n"] == 4


def _records(settings) -> SettingsRecords:
    return SettingsRecords(
        made=Made(commit="c", cpu="AVX2", date="d"),
        sweeps=[SweepSource(name="s", config_hash="h", kind="real-sweep")],
        settings=settings,
    )


def test_refit_reports_both_training_sets():
    settings = [
        setting(f"r{i}", "merge" if x < 0 else "compose", {"x": float(x)}, skills=(f"p{i}", f"q{i}"))
        for i, x in enumerate([-3, -2, -1, 1, 2, 3])
    ]
    results = refit(settings)
    for train in ("all", "real"):
        held = results["fits"][train]["heldout"]
        assert held["rule"]["correct"] == 6  # x separates the labels in every fold
        assert held["baselines"]["always merge"]["correct"] == 3
        assert held["meets_target"]
    with pytest.raises(ValueError, match="no real setting"):
        refit([setting("z", "merge", {}, source="synthetic")])


def test_fit_rule_command(tmp_path, capsys):
    settings = [
        setting(f"r{i}", "merge" if x < 0 else "compose", {"x": float(x), "w": float(i % 2)}, skills=(f"p{i}", f"q{i}"))
        for i, x in enumerate([-3, -2, -1, 1, 2, 3])
    ]
    write_records(_records(settings), tmp_path / "records.json")
    out = tmp_path / "fit"
    assert main(["fit-rule", "--records", str(tmp_path / "records.json"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "fitted on all settings, 6 real settings held out: rule 100.0 %, always merge 50.0 %" in printed
    results = json.loads((out / "results.json").read_text())
    assert results["fits"]["real"]["heldout"]["rule"]["correct"] == 6
    rule = LabelRule.model_validate_json((out / "label_rule.json").read_text())
    assert rule.features() == ["x"]
    assert "| the rule | 100.0 % [61, 100] (6/6) |" in (out / "results.md").read_text()

    write_records(_records(settings[:5] + [setting("r9", "either", {"x": 0.0, "w": 0.0})]), tmp_path / "other.json")
    assert main(["fit-rule", "--records", str(tmp_path / "other.json"), "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("mergecompose fit-rule: error:") and "holds the results of another config" in error
    assert json.loads((out / "results.json").read_text()) == results  # nothing of the first run lost
