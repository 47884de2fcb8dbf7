"""Merge or compose? The statistics, the verdict rule, the proxy-owner diagnostics, the predict-sweep
end to end (4 settings, scaled down) and `mergecompose overlap --recommend`."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from scipy import stats

from mergecompose.analysis import OverlapSettings
from mergecompose.analysis.data import char_tokenizer
from mergecompose.analysis.diagnostics import expert_activity
from mergecompose.analysis.paired_outcome import paired_outcome
from mergecompose.analysis.predict import (
    VERDICTS,
    Threshold,
    VerdictRule,
    combine_verdict,
    diagnostic_names,
    load_rule,
    proxy_owner_statistics,
    recommend,
)
from mergecompose.cli import main
from mergecompose.composition import ComposedLM
from mergecompose.composition.rule import compose_logprobs
from mergecompose.experiments.trained_models import prepare_components
from mergecompose.studies.predict import PredictConfig, predict_sweep
from mergecompose.studies.predict.predict_config import SettingSpec
from mergecompose.studies.predict.predict_sweep import CACHED, measure_setting
from mergecompose.studies.predict.stats import (
    correlation_with_interval,
    fit_threshold,
    leave_one_family_out,
)

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------- statistics


def test_spearman_and_partial_spearman_match_scipy_and_the_textbook_formula():
    rng = np.random.default_rng(0)
    z = rng.normal(size=40)
    x = z + rng.normal(size=40)
    y = z + 0.5 * rng.normal(size=40)
    plain = correlation_with_interval(x, y, resamples=500)
    reference = stats.spearmanr(x, y)
    assert plain["rho"] == pytest.approx(reference.statistic, abs=1e-12)
    assert plain["p"] == pytest.approx(reference.pvalue, rel=1e-9)
    assert plain["ci95"][0] < plain["rho"] < plain["ci95"][1] and plain["n"] == 40
    # Partial ρ from the pairwise Spearman coefficients (Pearson's partial correlation on ranks).
    r_xy, r_xz, r_yz = (stats.spearmanr(a, b).statistic for a, b in ((x, y), (x, z), (y, z)))
    textbook = (r_xy - r_xz * r_yz) / math.sqrt((1 - r_xz**2) * (1 - r_yz**2))
    partial = correlation_with_interval(x, y, control=z, resamples=500)
    assert partial["rho"] == pytest.approx(textbook, abs=1e-12)
    assert abs(partial["rho"]) < abs(plain["rho"])  # x and y are related only through z
    # A constant outcome has no ρ.
    assert correlation_with_interval(x, np.zeros(40))["rho"] is None


def test_fit_threshold_picks_the_separating_feature_and_a_constant_for_one_outcome():
    features = {"noise": np.array([0.3, 0.1, 0.9, 0.5, 0.2, 0.7]), "overlap": np.array([0.1, 0.2, 0.3, 0.6, 0.7, 0.8])}
    success = np.array([True, True, True, False, False, False])
    rule = fit_threshold(features, success)
    assert (rule.feature, rule.direction, rule.training_accuracy) == ("overlap", "below", 1.0)
    assert rule.threshold == pytest.approx(0.45)
    assert rule.predict({"overlap": 0.44}) and not rule.predict({"overlap": 0.45})
    # Balanced accuracy: one failure among ten is not ignored for the sake of 90 % plain accuracy.
    rare = fit_threshold({"a": np.arange(10.0)}, np.array([True] * 8 + [False, True]))
    assert (rare.direction, rare.threshold) == ("below", 7.5)
    assert rare.training_accuracy == pytest.approx((8 / 9 + 1) / 2)
    constant = fit_threshold(features, np.ones(6, dtype=bool))
    assert constant.feature is None and constant.predict({}) is True
    with pytest.raises(ValueError, match="overlap"):
        rule.predict({"noise": 0.1})


@pytest.mark.parametrize(
    ("compose", "merge", "remedy", "verdict"),
    [
        (True, True, True, "either"),
        (True, False, False, "compose"),
        (False, True, True, "merge"),
        (False, False, True, "compose+gate"),
        (False, False, False, "neither"),
    ],
)
def test_combine_verdict(compose, merge, remedy, verdict):
    assert combine_verdict(compose, merge, remedy) == verdict


def _record(name, family, overlap, compose, merge, remedy=None):
    return {
        "name": name,
        "family": family,
        "diagnostics": {"overlap": overlap, "k": 2.0},
        "outcomes": {
            "compose": compose,
            "best_merge": merge,
            "best_remedy": compose if remedy is None else remedy,
            "experts": {"a": 1.0, "b": 1.0},
        },
    }


def test_leave_one_family_out_scores_each_family_with_a_rule_fitted_on_the_others():
    # Composition fails above overlap 0.5 in every family; merges always fail.
    records = [
        _record(f"{family}{i}", family, overlap, 1.0 if overlap < 0.5 else 0.2, 0.0)
        for family in ("a", "b", "c")
        for i, overlap in enumerate((0.1, 0.3, 0.6, 0.9))
    ]
    result = leave_one_family_out(records, ["overlap", "k"], 0.9)
    assert result["heldout_accuracy"] == 1.0 and result["n_settings"] == 12
    assert result["confusion"]["compose"]["compose"] == 6 and result["confusion"]["neither"]["neither"] == 6
    # Family c reverses the relation: the rule fitted on a and b gets all of c wrong, and says so.
    records[8:] = [
        _record(f"c{i}", "c", overlap, 0.2 if overlap < 0.5 else 1.0, 0.0)
        for i, overlap in enumerate((0.1, 0.3, 0.6, 0.9))
    ]
    result = leave_one_family_out(records, ["overlap", "k"], 0.9)
    assert result["per_family"]["c"]["accuracy"] == 0.0
    assert sum(sum(row.values()) for row in result["confusion"].values()) == 12


# ---------------------------------------------------------------------------------- diagnostics


def test_proxy_owner_statistics_match_a_loop_over_positions(base_model, expert_models):
    composed = ComposedLM(base_model, expert_models, weights=[1.0, 0.7])
    input_ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, :2] = False
    result = proxy_owner_statistics(composed, [{"input_ids": input_ids, "measure_mask": mask}], epsilon=0.05)

    components = composed.component_logprobs(input_ids)  # (3, B, T, V)
    flips = shifts = low = entropy = 0.0
    positions = [(b, t) for b in range(2) for t in range(7) if mask[b, t]]
    for b, t in positions:
        base, experts = components[0, b, t], components[1:, b, t]
        full = compose_logprobs(base, list(experts), [1.0, 0.7])
        activity = expert_activity(base, experts)  # (2,)
        owner = int(activity.argmax())
        if activity[owner] > 0.05:
            alone = compose_logprobs(base, [experts[owner]], [[1.0, 0.7][owner]])
        else:
            alone = torch.log_softmax(base, -1)
        flips += float(alone.argmax() != full.argmax())
        shifts += float((alone.exp() * (alone - full)).sum())
        low += float(full.exp().max() < 0.5)
        entropy += float(-(full.exp() * full).sum())
    n = len(positions)
    assert result["silent_flip_rate"] == pytest.approx(flips / n, abs=1e-9)
    assert result["silent_shift_kl"] == pytest.approx(shifts / n, rel=1e-4, abs=1e-7)
    assert result["low_confidence_rate"] == pytest.approx(low / n, abs=1e-9)
    assert result["composed_entropy"] == pytest.approx(entropy / n, rel=1e-5)
    assert 0 < result["silent_flip_rate"] < 1  # random experts: the silent one flips some argmaxes, not all


def test_the_shipped_rule_loads_and_gives_a_verdict():
    rule = load_rule()
    assert rule.sweep["name"] == "predict" and rule.n_settings >= 30
    features = {getattr(rule, name).feature for name in ("compose", "merge", "remedy")} - {None}
    diagnostics = dict.fromkeys(features, 0.0)
    assert recommend(rule, diagnostics)["verdict"] in VERDICTS


# ---------------------------------------------------------------------------------- the sweep, scaled down

LETTERS = {
    "task": {"train_lengths": [1, 6]},
    "positions": {"max_position": 48},
    "evaluation": {"lengths": [6]},
    "model": {"hidden_size": 32, "max_position_embeddings": 48},
    "training": {
        "base": {"steps": 150, "batch_size": 32, "lr": 0.005},
        "experts": {
            "full": {"steps": 40, "batch_size": 32, "lr": 0.002},
            "lora": {"rank": 4, "alpha": 8, "training": {"steps": 40, "batch_size": 32, "lr": 0.01}},
        },
    },
}
SKILLS = {
    "task": {"train_lengths": [1, 12], "segment_lengths": [2, 3]},
    "positions": {"max_position": 64},
    "evaluation": {"lengths": [12]},
    "model": {"hidden_size": 32, "max_position_embeddings": 64},
    "training": {
        "base": {"steps": 150, "batch_size": 32, "lr": 0.005},
        "experts": {"full": {"steps": 60, "batch_size": 32, "lr": 0.003}},
    },
}
SMALL = {
    "name": "small",
    "test_size": 24,
    "validation_size": 12,
    "diagnostic_prompts": 8,
    "bootstrap": 200,
    "batch_size": 64,
    "merges": {"task_arithmetic": {"lam": [0.5, 1.0]}},
    "families": {
        "letters": {
            "compare": str(ROOT / "configs/letters.yaml"),
            "overrides": LETTERS,
            "letter_skills": {"ab": {"A": "B"}, "cd": {"C": "D"}, "ac": {"A": "C"}},
            "settings": [{"name": "ab_cd", "pair": ["ab", "cd"]}, {"name": "ab_ac", "pair": ["ab", "ac"]}],
        },
        "skills": {
            "compare": str(ROOT / "configs/skills_k2.yaml"),
            "overrides": SKILLS,
            "settings": [{"name": "k2", "k": 2}, {"name": "k3_noisy", "k": 3, "expert_noise": 0.35}],
        },
    },
}


@pytest.fixture(scope="module")
def small_sweep(tmp_path_factory):
    folder = tmp_path_factory.mktemp("predict")
    config_path = folder / "predict.yaml"
    config_path.write_text(yaml.safe_dump(SMALL))
    out = folder / "out"
    assert main(["predict-sweep", str(config_path), "--out", str(out), "--quiet"]) == 0
    return config_path, out, json.loads((out / "predict.json").read_text())


def test_predict_sweep_writes_the_schema_the_issue_names(small_sweep):
    _, out, results = small_sweep
    for name in ["predict.json", "predict.md", "predict_rule.json", "config.yaml", "scatter_compose_error.png"]:
        assert (out / name).stat().st_size > 0
    assert [s["name"] for s in results["settings"]] == ["ab_cd", "ab_ac", "k2", "k3_noisy"]
    for setting in results["settings"]:
        assert set(setting) >= {"name", "family", "diagnostics", "outcomes"}
        outcomes = setting["outcomes"]
        for key in ("compose", "best_remedy", "best_merge"):
            assert 0.0 <= outcomes[key] <= 1.0
        assert set(outcomes["experts"]) == set(setting["experts"])
        assert outcomes["best_remedy"] == max(outcomes["remedies"].values())
        # The paired label: the best merge against the composition chosen on validation, item by item.
        paired = setting["paired"]
        validation = paired["composition_validation"]
        assert set(validation) == {"compose", *outcomes["remedies"]}
        assert paired["composition"] == max(validation, key=validation.get)
        tested = {"compose": outcomes["compose"], **outcomes["remedies"]}
        assert sum(paired["compose_rights"]) / len(paired["compose_rights"]) == tested[paired["composition"]]
        assert sum(paired["merge_rights"]) / len(paired["merge_rights"]) == outcomes["best_merge"]
        assert len(paired["merge_rights"]) == SMALL["test_size"]
        expected = paired_outcome(paired["merge_rights"], paired["compose_rights"]).to_dict()
        assert {key: paired[key] for key in expected} == expected
        assert {
            "coactivation_rate@0.1",
            "mass_overlap_max",
            "mass_overlap_max_median",
            "sign_conflict_max",
            "sign_conflict_max_median",
            "merge_compose_kl",
            "merge_compose_top1_disagreement",
            "interaction_residual_relative",
            "parameter_cosine_max",
            "parameter_ties_sign_conflict_max",
            "silent_flip_rate",
        } <= set(setting["diagnostics"])
    assert [len(s["experts"]) for s in results["settings"]] == [2, 2, 2, 3]
    # The letter experts learn their rules here; the conflicting pair accepts either letter.
    letters = results["settings"][0]["outcomes"]
    assert letters["experts"] == {"ab": 1.0, "cd": 1.0} and letters["compose"] >= 0.9
    for entry in results["diagnostics"].values():
        assert set(entry) == {"spearman_compose_error", "spearman_merge_error", "spearman_gap", "partial_compose_error"}
        assert set(entry["spearman_compose_error"]) == {"rho", "ci95", "p", "n"}
    assert set(results["verdict"]) >= {"heldout_accuracy", "confusion", "n_settings"}
    assert results["verdict"]["n_settings"] == 4
    assert sum(sum(row.values()) for row in results["verdict"]["confusion"].values()) == 4
    rule = VerdictRule.model_validate(json.loads((out / "predict_rule.json").read_text()))
    assert rule.sweep["name"] == "small" and rule.heldout_accuracy == results["verdict"]["heldout_accuracy"]
    assert "## The verdict rule" in (out / "predict.md").read_text()
    assert f"| {results['settings'][0]['paired']['label']} (" in (out / "predict.md").read_text()


def test_fit_verdict_reads_a_predict_sweep(small_sweep, tmp_path):
    _, out, results = small_sweep
    assert main(["fit-verdict", "--predict", str(out), "--out", str(tmp_path / "verdict"), "--quiet"]) == 0
    verdict = json.loads((tmp_path / "verdict" / "verdict.json").read_text())
    assert [row["label"] for row in verdict["rows"]] == [s["paired"]["label"] for s in results["settings"]]
    # Two families: each setting's rule is fitted on the other family's two settings.
    assert [row["fitted_on"] for row in verdict["rows"]] == [2, 2, 2, 2]
    assert verdict["n_real"] == 0 and verdict["heldout"]["all"]["rule"]["n"] == 4


def test_predict_sweep_resumes_from_the_settings_it_has_measured(small_sweep, capsys):
    config_path, out, results = small_sweep
    (out / "settings" / "k2.json").unlink()  # as if the run had stopped before this setting
    before = (out / "settings" / "ab_cd.json").stat().st_mtime_ns
    assert main(["predict-sweep", str(config_path), "--out", str(out), "--quiet"]) == 0
    again = json.loads((out / "predict.json").read_text())
    assert (out / "settings" / "ab_cd.json").stat().st_mtime_ns == before  # reused, not measured again
    assert (out / "settings" / "k2.json").is_file()
    assert [s["outcomes"] for s in again["settings"]] == [s["outcomes"] for s in results["settings"]]
    # Another config in the same folder is refused, in one line, before any work.
    other = yaml.safe_load(config_path.read_text())
    other["test_size"] = 10
    other_path = config_path.with_name("other.yaml")
    other_path.write_text(yaml.safe_dump(other))
    capsys.readouterr()
    assert main(["predict-sweep", str(other_path), "--out", str(out)]) == 2
    assert "another config" in capsys.readouterr().err


def test_a_setting_measured_before_a_diagnostic_gains_it_without_its_systems_again(small_sweep, monkeypatch):
    config_path, out, results = small_sweep
    path = out / "settings" / "ab_cd.json"
    before = json.loads(path.read_text())
    assert set(diagnostic_names(OverlapSettings(**SMALL.get("overlap", {})))) <= set(before["diagnostics"])
    older = dict(before, diagnostics={k: v for k, v in before["diagnostics"].items() if k != "silent_flip_rate"})
    path.write_text(json.dumps(older))

    def refuse(*args, **kwargs):
        raise AssertionError("a cached setting's systems were scored again")

    monkeypatch.setattr(predict_sweep, "measure_setting", refuse)
    assert main(["predict-sweep", str(config_path), "--out", str(out), "--quiet"]) == 0
    after = json.loads(path.read_text())
    assert after["diagnostics"] == pytest.approx(before["diagnostics"], nan_ok=True)  # measured again, alike
    after.pop("diagnostics"), before.pop("diagnostics")
    assert after == before  # the rest of the record as it was
    again = json.loads((out / "predict.json").read_text())
    assert "silent_flip_rate" in again["settings"][0]["diagnostics"]


def test_ctrl_c_keeps_the_finished_settings_and_the_same_command_goes_on(small_sweep, tmp_path):
    """A real SIGINT to `mergecompose predict-sweep` once a setting has finished: one line, exit status 130, the
    finished settings kept whole, and the same command goes on from them to the uninterrupted run's results."""
    config_path, measured, results = small_sweep
    out = tmp_path / "out"
    for name in CACHED:  # a run that has measured the letter settings and not the others
        shutil.copytree(measured / name, out / name)
    for name in ("k2", "k3_noisy"):
        (out / "settings" / f"{name}.json").unlink()
    argv = ["predict-sweep", str(config_path), "--out", str(out), "--quiet"]
    process = subprocess.Popen(
        [sys.executable, "-m", "mergecompose.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 240
    while not (out / "settings" / "k2.json").is_file() and time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert stderr.splitlines()[-1] == (
        f"mergecompose predict-sweep: interrupted (Ctrl-C); every finished cell is kept in {out}, and the same "
        "command resumes from them (cells in flight were stopped)"
    )
    kept = json.loads((out / "settings" / "k2.json").read_text())  # whole: it parses
    assert not (out / "predict.json").exists()
    assert main(argv) == 0
    again = json.loads((out / "predict.json").read_text())
    assert [s["outcomes"] for s in again["settings"]] == [s["outcomes"] for s in results["settings"]]
    assert json.loads((out / "settings" / "k2.json").read_text()) == kept  # reused, not measured again


def test_predict_sweep_refuses_a_bad_config_before_training(tmp_path, capsys):
    bad = json.loads(json.dumps(SMALL))
    bad["families"]["letters"]["settings"][1]["pair"] = ["ab", "xy"]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert main(["predict-sweep", str(path), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("mergecompose predict-sweep: error:") and "'xy'" in error and "\n" not in error
    assert not (tmp_path / "out" / "checkpoints").exists()


# ---------------------------------------------------------------------------------- --recommend


def test_overlap_recommend_prints_the_rule_s_verdict_on_these_diagnostics(checkpoints, tmp_path, capsys):
    base = tmp_path / "base"
    shutil.copytree(checkpoints / "base", base)
    char_tokenizer("ABCDEFGH >").save_pretrained(base)
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "\n".join(json.dumps({"prompt": p, "completion": "AB"}) for p in ("ABCD >", "HGFE >", "CAFE >")) + "\n"
    )
    rule = VerdictRule(
        compose=Threshold(feature="silent_flip_rate", threshold=0.5, direction="below"),
        merge=Threshold(feature="merge_compose_kl", threshold=0.05, direction="below"),
        remedy=Threshold(constant=False),
        heldout_accuracy=0.75,
        n_settings=4,
        sweep={"name": "test", "version": 1},
    )
    rule_path = tmp_path / "rule.json"
    rule_path.write_text(rule.model_dump_json())
    out = tmp_path / "out"
    args = [
        "overlap",
        "--base",
        str(base),
        "--expert",
        str(checkpoints / "expert_0"),
        "--expert",
        str(checkpoints / "expert_1"),
        "--data",
        str(data),
        "--max-new-tokens",
        "3",
        "--quiet",
    ]
    assert main([*args, "--recommend", "--rule", str(rule_path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    recommendation = json.loads((out / "overlap.json").read_text())["recommendation"]
    diagnostics = recommendation["diagnostics"]
    assert recommendation["verdict"] == rule.verdict(diagnostics)
    # A rule without figures on real experts: its verdict is shown as what it would say, not as a decision.
    assert recommendation["decision"] is False and recommendation["real_settings"] is None
    assert "No recommendation: this rule was not measured on real experts" in printed
    assert f"what the rule would say (not a decision): {recommendation['verdict']}" in printed
    assert "synthetic tasks" in printed and "Recommendation:" not in printed
    assert f"silent_flip_rate = {diagnostics['silent_flip_rate']:.4g}" in printed
    # Random experts, the task-arithmetic merge built in memory: they disagree, so the gap is large.
    assert diagnostics["merge_compose_kl"] > 0.05
    assert (
        "## Merge or compose?\n\n```\nNo recommendation: this rule was not measured" in (out / "overlap.md").read_text()
    )
    # A rule without --recommend is refused in one line.
    assert main([*args, "--rule", str(rule_path), "--out", str(tmp_path / "out2")]) == 2
    assert "--recommend" in capsys.readouterr().err


def test_a_setting_s_expert_noise_reaches_its_experts(small_sweep):
    config_path, out, _ = small_sweep
    config = PredictConfig.model_validate(yaml.safe_load(config_path.read_text()))
    family = config.families["skills"]
    components = prepare_components(config.compare_config("skills"), out, progress=False)  # cached: nothing trains
    measured = {}
    for noise in (0.0, 0.35):
        setting = SettingSpec(name=f"k2_{noise}", k=2, expert_noise=noise)
        compare = config.setting_config("skills", setting)
        variant = dataclasses.replace(components, expert_variant=compare.task.expert_variant)
        measured[noise] = measure_setting(config, compare, family, setting, variant)["diagnostics"]
    # Noise of 0.35 × RMS on every task-vector tensor: other task vectors, other outputs.
    for name in ("parameter_cosine_max", "parameter_ties_sign_conflict_max", "expert_kl_mean"):
        assert measured[0.35][name] != pytest.approx(measured[0.0][name], rel=1e-3), name
