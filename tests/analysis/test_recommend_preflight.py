"""`mergecompose overlap --recommend` where a diagnostic the rule reads is undefined: the verdict degrades and says
why; what the rule reads is known before any model loads; relative paths of an overlap YAML."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from mergecompose.analysis.data import char_tokenizer
from mergecompose.analysis.overlap_run import read_overlap_yaml
from mergecompose.analysis.overlap_settings import OverlapSettings
from mergecompose.analysis.predict import (
    UNDECIDED,
    VERDICTS,
    Threshold,
    VerdictRule,
    check_rule_diagnostics,
    diagnostic_names,
    load_rule,
    possible_verdicts,
)
from mergecompose.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(
    ("compose", "merge", "remedy", "possible"),
    [
        (True, False, None, ["compose"]),  # the remedy matters only when both fail
        (False, True, None, ["merge"]),
        (False, False, None, ["compose+gate", "neither"]),
        (None, True, False, ["either", "merge"]),
        (None, None, None, list(VERDICTS)),
        (False, False, True, ["compose+gate"]),
    ],
)
def test_possible_verdicts_are_those_every_unknown_answer_allows(compose, merge, remedy, possible):
    assert possible_verdicts(compose, merge, remedy) == possible


def test_a_rule_reading_an_unmeasured_diagnostic_is_refused_by_name():
    check_rule_diagnostics(load_rule())  # the shipped rule reads only what the overlap measures
    names = diagnostic_names(OverlapSettings(epsilons=[0.2]))
    assert "coactivation_rate@0.2" in names and "coactivation_rate@0.1" not in names
    rule = VerdictRule(
        compose=Threshold(constant=True),
        merge=Threshold(feature="silent_flip_rat", threshold=0.1),
        remedy=Threshold(constant=False),
    )
    with pytest.raises(
        ValueError, match=r"`merge` reads diagnostic 'silent_flip_rat'.*did you mean 'silent_flip_rate'"
    ):
        check_rule_diagnostics(rule)


@pytest.fixture(scope="module")
def coactive_run(checkpoints, tmp_path_factory):
    """`overlap --recommend` with the shipped rule on two random experts: both change every token's distribution,
    so no position has a single active expert and the single-active projective error is undefined."""
    folder = tmp_path_factory.mktemp("coactive")
    base = folder / "base"
    shutil.copytree(checkpoints / "base", base)
    char_tokenizer("ABCDEFGH >").save_pretrained(base)
    data = folder / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p, "completion": "AB"}) for p in ("ABCD >", "HGFE >")) + "\n")
    out = folder / "out"
    argv = ["overlap", "--base", str(base), "--data", str(data), "--max-new-tokens", "3", "--quiet", "--recommend"]
    argv += ["--expert", str(checkpoints / "expert_0"), "--expert", str(checkpoints / "expert_1"), "--out", str(out)]
    return main(argv), out


def test_recommend_degrades_where_every_position_is_co_active(coactive_run, capsys):
    code, out = coactive_run
    assert code == 0  # the run finishes and writes everything
    for name in ("overlap.json", "overlap.md", "config.yaml", "activity_heatmap.png", "gap_histogram.png"):
        assert (out / name).stat().st_size > 0
    results = json.loads((out / "overlap.json").read_text())
    recommendation, diagnostics = results["recommendation"], results["recommendation"]["diagnostics"]
    assert set(diagnostics) == set(diagnostic_names(OverlapSettings()))  # the names are known before measuring
    assert diagnostics["coactivation_rate@0.1"] == 1.0 and diagnostics["projective_error"] is None
    rule = load_rule()
    assert rule.remedy.feature == "projective_error"  # the shipped rule reads it
    assert "co-active" in recommendation["undefined"]["projective_error"]
    assert recommendation["possible_verdicts"] == rule.possible_verdicts(diagnostics)
    expected = recommendation["possible_verdicts"][0] if len(recommendation["possible_verdicts"]) == 1 else UNDECIDED
    assert recommendation["verdict"] == expected
    assert (
        "undefined: projective_error: no measured position has at most one active expert"
        in (out / "overlap.md").read_text()
    )
    # The other measurements are all there.
    assert results["rollouts"]["composed"]["num_positions"] > 0 and results["merge_compose_gap"]["kl_mean"] > 0


def test_the_verdict_is_undecided_only_where_the_undefined_diagnostic_matters(coactive_run):
    _, out = coactive_run
    diagnostics = json.loads((out / "overlap.json").read_text())["recommendation"]["diagnostics"]
    remedy = Threshold(feature="projective_error", threshold=0.01, direction="below")
    fails, succeeds = Threshold(constant=False), Threshold(constant=True)
    both_fail = VerdictRule(compose=fails, merge=fails, remedy=remedy)
    assert both_fail.verdict(diagnostics) == UNDECIDED
    assert both_fail.possible_verdicts(diagnostics) == ["compose+gate", "neither"]
    assert "projective_error is undefined → unknown" in remedy.describe(diagnostics)
    assert VerdictRule(compose=fails, merge=succeeds, remedy=remedy).verdict(diagnostics) == "merge"
    with pytest.raises(ValueError, match="projective_error"):
        remedy.predict(diagnostics)  # the strict prediction, for the sweep's own fits, still refuses


def test_relative_paths_of_an_overlap_yaml_are_read_from_its_folder(tmp_path):
    folder = tmp_path / "configs"
    (folder / "models" / "base").mkdir(parents=True)
    path = folder / "overlap.yaml"
    values = {
        "base": "models/base",
        "experts": ["./models/expert", "owner/name", "/abs/expert"],
        "tokenizer": "gpt2",
        "data": "data.jsonl",
        "out": "../runs/overlap",
        "rule": "rule.json",
    }
    path.write_text(yaml.safe_dump(values))
    resolved = read_overlap_yaml(path)
    assert resolved["base"] == str(folder / "models/base") and resolved["data"] == str(folder / "data.jsonl")
    # A hub id (owner/name with no such local folder, a bare name) stays one; an absolute path stays as it is.
    assert resolved["experts"] == [str(folder / "models/expert"), "owner/name", "/abs/expert"]
    assert resolved["tokenizer"] == "gpt2"
    assert resolved["out"] == str(folder / "../runs/overlap") and resolved["rule"] == str(folder / "rule.json")
