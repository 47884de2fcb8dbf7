"""The sequential-skills task through `mergecompose compare`, end to end, on configs/skills_k3_test.yaml (k = 3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from mergecompose.experiments.compare import run_compare
from mergecompose.experiments.compare_config import CompareConfig, load_config
from mergecompose.experiments.trained_models import prepare_components
from mergecompose.studies.skills.skills_sweep import load_sweep_configs, run_skills_sweep, summarize, summary_markdown

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "skills_k3_test.yaml"
REMEDIES = {"compose+gate", "compose+plausible", "compose+eos_base", "compose+eos_active", "compose+all"}
EXPERTS = ["shift", "mirror", "reverse"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """The k = 3 config run as a one-config `skills-sweep` (which runs `run_compare` in `OUT/<name>`)."""
    root = tmp_path_factory.mktemp("skills")
    (root / "shared").mkdir()  # a checkpoints folder of another sweep, reused through `checkpoints`
    summary = run_skills_sweep(
        load_sweep_configs([CONFIG]), root / "sweep", progress=False, echo=None, checkpoints=root / "shared"
    )
    return root / "sweep", summary


@pytest.fixture(scope="module")
def skills_run(sweep):
    out_dir = sweep[0] / "skills_k3_test"
    return load_config(CONFIG), out_dir, json.loads((out_dir / "results.json").read_text())


def test_config_is_the_skills_task_at_k_3():
    config = load_config(CONFIG)
    assert config.task.type == "skills" and config.task.num_experts == 3 and config.task.joint == EXPERTS
    assert set(config.remedies) == {name.removeprefix("compose+") for name in REMEDIES}


def test_outputs_and_results_schema(skills_run):
    config, out_dir, results = skills_run
    assert {p.name for p in out_dir.iterdir()} >= {
        "results.json",
        "results.md",
        "length.png",
        "activity.png",
        "config.yaml",
    }
    assert load_config(out_dir / "config.yaml") == config  # the resolved config, task type included
    singles = {"base"} | {f"expert:{n}{s}" for n in EXPERTS for s in ("", ":lora")}
    assert (
        set(results["systems"])
        == singles | {"compose", "compose:lora", "merge:task_arithmetic", "merge:ties"} | REMEDIES
    )
    splits = ["joint", "only_shift", "only_mirror", "only_reverse", "neither", "length_20"]
    for name, record in results["systems"].items():
        assert list(record["splits"]) == splits
        assert list(record["by_length"]) == ["10", "20"]
        for split in splits:
            cell = record["splits"][split]
            assert 0 <= cell["ci95"][0] <= cell["exact_match"] <= cell["ci95"][1] <= 1
        expected = (
            "copy" if name == "base" else (f"skill:{name.split(':')[1]}" if name.startswith("expert:") else "joint")
        )
        assert record["target"] == expected
    assert results["systems"]["compose"]["splits"]["joint"]["n"] == 48


def test_real_greedy_failures_agree_with_teacher_forced_exact_match(skills_run):
    # Greedy decoding reproduces the target iff every teacher-forced argmax is right, so the failure
    # analysis (real KV-cached decoding) and the teacher-forced scores must agree exactly, remedies
    # included; and a first error at the END step is the teacher-forced first error at index L.
    _, _, results = skills_run
    failures = results["skills_failures"]
    assert failures["num_experts"] == 3
    combined = {n for n in results["systems"] if n.startswith(("compose", "merge:"))}
    assert set(failures["systems"]) == combined
    for name in combined:
        for split, length in [("joint", 10), ("length_20", 20)]:
            summary = failures["systems"][name][split]
            scored = results["systems"][name]["splits"][split]
            assert summary["n"] == scored["n"]
            assert summary["exact_match"] == pytest.approx(scored["exact_match"])
            assert summary["first_error"]["end"] == pytest.approx(
                scored["first_error"].get(str(length), 0) / scored["n"]
            )
            assert summary["exact_match"] + sum(summary["first_error"].values()) == pytest.approx(1.0)
            assert sum(summary["eos"].values()) == pytest.approx(1.0)
            assert summary["first_error_is_eos"] <= summary["eos"]["early"] + 1e-9


def test_noise_section(skills_run):
    _, _, results = skills_run
    noise = results["skills_failures"]["noise"]
    assert set(noise) == {"joint", "length_20"}
    for record in noise.values():
        assert set(record["inactive_activity"]) == {"background", "segment", "boundary", "end"}
        assert all(value is None or value >= 0 for value in record["inactive_activity"].values())
        assert all(value is None or value >= -1e-6 for value in record["oracle_shift"].values())
        assert 0 <= record["coactivation_rate"] <= 1 and 0 <= record["spurious_activity_rate"] <= 1
        assert set(record["own_segment_activity"]) == {"expert_0", "expert_1", "expert_2"}
    # The heatmap of activity.png: 3 sequences, 3 experts x (L + 1) steps, one segment per expert.
    heatmap = noise["joint"]["heatmap"]
    assert noise["joint"]["experts"] == ["expert_0", "expert_1", "expert_2"] and len(heatmap) == 3
    for row in heatmap:
        assert len(row["activity"]) == 3 and all(len(values) == 11 for values in row["activity"])
        assert row["next_tokens"][-1] == "<eos>" and len(row["next_tokens"]) == 11
        assert all(0 <= start < stop <= 10 for start, stop in row["intervals"])


def test_checkpoints_are_shared_across_k(skills_run):
    # The base and the experts do not depend on k: the k = 2 run of the same family trains nothing.
    config, out_dir, _ = skills_run
    data = config.model_dump(mode="json")
    data["task"]["num_experts"] = 2
    smaller = prepare_components(CompareConfig.model_validate(data), out_dir, progress=False)
    assert all(record["cached"] for record in smaller.training.values())
    assert set(smaller.experts) == {"shift", "mirror"}
    assert smaller.base_dir == Path(json.loads((out_dir / "results.json").read_text())["checkpoints"]["base"])


def test_sweep_shares_checkpoints_and_writes_the_summary(sweep, skills_run):
    out_dir, summary = sweep
    _, run_dir, results = skills_run
    assert (run_dir / "checkpoints").is_symlink() and (run_dir / "checkpoints").resolve() == (
        out_dir / "checkpoints"
    ).resolve()
    assert (out_dir / "checkpoints").resolve() == (out_dir.parent / "shared").resolve()
    assert any(path.name.startswith("base-") for path in (out_dir.parent / "shared").iterdir())
    with pytest.raises(ValueError, match="is not a link to `checkpoints`"):
        run_skills_sweep(load_sweep_configs([CONFIG]), out_dir, echo=None, checkpoints=run_dir)
    assert json.loads((out_dir / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert (out_dir / "accuracy_vs_k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["ks"] == [3] and set(summary["systems"]) == {
        n for n in results["systems"] if n.startswith(("compose", "merge:"))
    }
    for name, per_k in summary["systems"].items():
        assert per_k["3"]["joint"] == results["systems"][name]["splits"]["joint"]
        assert per_k["3"]["lengths"] == {"length_20": results["systems"][name]["splits"]["length_20"]["exact_match"]}
    assert "| compose+all |" in (out_dir / "summary.md").read_text()
    assert "Whose segment the first error falls in" in (out_dir / "summary.md").read_text()


def test_first_errors_by_owning_skill_add_up_to_segment_and_boundary(skills_run):
    # Owners cover a segment and its markers; background and end steps have none.
    _, _, results = skills_run
    for _name, per_split in results["skills_failures"]["systems"].items():
        for summary in per_split.values():
            assert list(summary["first_error_owner"]) == EXPERTS
            first = summary["first_error"]
            assert sum(summary["first_error_owner"].values()) == pytest.approx(first["segment"] + first["boundary"])


def test_summary_orders_runs_by_k():
    # Two runs given out of order (k = 4 first) come out as columns k = 2, 4.
    def fake(k, value):
        cell = {"exact_match": value, "n": 10, "ci95": [0.0, 1.0], "first_error": {}}
        return {
            "config": {"task": {"num_experts": k, "expert_noise": 0.0}},
            "data": {"main_length": 32},
            "systems": {
                "compose": {"splits": {"joint": cell, "length_64": cell}, "by_length": {}},
                "base": {"splits": {"joint": cell}, "by_length": {"32": 1.0}},
            },
        }

    summary = summarize([fake(4, 0.5), fake(2, 0.9)])
    assert summary["ks"] == [2, 4]
    assert summary["systems"]["compose"]["2"]["joint"]["exact_match"] == 0.9
    assert summary["systems"]["compose"]["4"]["lengths"] == {"length_64": 0.5}
    assert "| compose | 90.0 [0.0, 100.0] | 50.0 [0.0, 100.0] |" in summary_markdown(summary)


def test_sweep_configs_are_checked(tmp_path):
    letters = Path(__file__).resolve().parents[2] / "configs" / "letters.yaml"
    with pytest.raises(ValueError, match="`task.type` must be 'skills'"):
        load_sweep_configs([letters])
    with pytest.raises(ValueError, match="`name`s must differ"):
        load_sweep_configs([CONFIG, CONFIG])
    renamed = tmp_path / "renamed.yaml"
    renamed.write_text(CONFIG.read_text().replace("name: skills_k3_test", "name: other"))
    with pytest.raises(ValueError, match="different numbers of experts"):
        load_sweep_configs([CONFIG, renamed])
    noisy = load_sweep_configs([CONFIG], expert_noise=0.5)
    assert noisy[0].task.expert_noise == 0.5


def _double_config(scheme: str) -> dict:
    """The k = 3 test config with `double` as the third skill (it changes the output's length)."""
    data = yaml.safe_load(CONFIG.read_text())
    data["name"] = "skills_double_test"
    data["task"]["skills"][2] = {"name": "double", "open": "{", "close": "}", "transform": "double"}
    data["positions"] = {"scheme": scheme, "randomize": False, "max_position": 96}
    data["model"]["max_position_embeddings"] = 96
    data["training"]["experts"]["lora"] = None
    data["merges"] = {"task_arithmetic": {"lam": [1.0]}}
    data["remedies"] = {"gate": {"gate": 0.1}, "eos_base": {"termination": "base"}}
    return data


def test_a_length_changing_skill_needs_contiguous_positions():
    with pytest.raises(
        ValueError, match=r"skills \['double'\] change the length of their segment; `positions.scheme: coupled`"
    ):
        CompareConfig.model_validate(_double_config("coupled"))
    config = CompareConfig.model_validate(_double_config("contiguous"))
    assert config.slots_needed(20) == 20 + 2 + 40  # the joint target may be twice the input
    # The failure analysis decodes `failure_margin` (8) tokens past the target: 62 + 8 positions.
    tight = _double_config("contiguous")
    tight["positions"]["max_position"] = 69
    with pytest.raises(
        ValueError, match=r"`positions.max_position` = 69 is too small for strings of length 20, .*\(needs 70 "
    ):
        CompareConfig.model_validate(tight)
    tight["positions"]["max_position"] = 70
    CompareConfig.model_validate(tight)


def test_a_length_changing_skill_end_to_end(tmp_path):
    config = CompareConfig.model_validate(_double_config("contiguous"))
    results = run_compare(config, tmp_path / "run", progress=False, echo=None)
    targets = [len(t) for t in config.task.eval_data(config.evaluation, config.eval_length, 10).test["joint"].targets]
    assert len(set(targets)) > 1 and max(targets) > config.eval_length  # targets longer than inputs, of several lengths
    failures = results["skills_failures"]
    for name in ["compose", "compose+gate", "compose+eos_base", "merge:task_arithmetic"]:
        for split in ["joint", "length_20"]:
            summary = failures["systems"][name][split]
            scored = results["systems"][name]["splits"][split]
            # Real greedy decoding and teacher-forced scoring agree with targets of varying length too.
            assert summary["exact_match"] == pytest.approx(scored["exact_match"])
            assert summary["exact_match"] + sum(summary["first_error"].values()) == pytest.approx(1.0)
    noise = failures["noise"]["joint"]
    for row, target in zip(noise["heatmap"], targets):
        assert len(row["next_tokens"]) == target + 1 and all(len(values) == target + 1 for values in row["activity"])
    assert 0 <= noise["coactivation_rate"] <= 1 and noise["inactive_activity"]["end"] is not None
    assert (tmp_path / "run" / "activity.png").is_file()
