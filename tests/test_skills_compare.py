"""The sequential-skills task through `mergecompose compare`, end to end, on configs/skills_k3_test.yaml (k = 3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tasks.compare import run_compare
from tasks.components import prepare_components
from tasks.config import CompareConfig, load_config

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "skills_k3_test.yaml"
REMEDIES = {"compose+gate", "compose+plausible", "compose+eos_base", "compose+eos_active", "compose+all"}
EXPERTS = ["shift", "mirror", "reverse"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def skills_run(tmp_path_factory):
    config = load_config(CONFIG)
    out_dir = tmp_path_factory.mktemp("skills") / "run"
    results = run_compare(config, out_dir, progress=False, echo=None)
    return config, out_dir, results


def test_config_is_the_skills_task_at_k_3():
    config = load_config(CONFIG)
    assert config.task.type == "skills" and config.task.num_experts == 3 and config.task.joint == EXPERTS
    assert set(config.remedies) == {name.removeprefix("compose+") for name in REMEDIES}


def test_outputs_and_results_schema(skills_run):
    config, out_dir, results = skills_run
    assert {p.name for p in out_dir.iterdir()} >= {"results.json", "results.md", "length.png", "config.yaml"}
    assert json.loads((out_dir / "results.json").read_text()) == json.loads(json.dumps(results))
    assert load_config(out_dir / "config.yaml") == config  # the resolved config, task type included
    singles = {"base"} | {f"expert:{n}{s}" for n in EXPERTS for s in ("", ":lora")}
    assert set(results["systems"]) == singles | {"compose", "compose:lora", "merge:task_arithmetic", "merge:ties"} | REMEDIES
    splits = ["joint", "only_shift", "only_mirror", "only_reverse", "neither", "length_20"]
    for name, record in results["systems"].items():
        assert list(record["splits"]) == splits
        assert list(record["by_length"]) == ["10", "20"]
        for split in splits:
            cell = record["splits"][split]
            assert 0 <= cell["ci95"][0] <= cell["exact_match"] <= cell["ci95"][1] <= 1
        expected = "copy" if name == "base" else (f"skill:{name.split(':')[1]}" if name.startswith("expert:") else "joint")
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
            assert summary["first_error"]["end"] == pytest.approx(scored["first_error"].get(str(length), 0) / scored["n"])
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


def test_checkpoints_are_shared_across_k(skills_run):
    # The base and the experts do not depend on k: the k = 2 run of the same family trains nothing.
    config, out_dir, _ = skills_run
    data = config.model_dump(mode="json")
    data["task"]["num_experts"] = 2
    smaller = prepare_components(CompareConfig.model_validate(data), out_dir, progress=False)
    assert all(record["cached"] for record in smaller.training.values())
    assert set(smaller.experts) == {"shift", "mirror"}
    assert smaller.base_dir == Path(json.loads((out_dir / "results.json").read_text())["checkpoints"]["base"])
