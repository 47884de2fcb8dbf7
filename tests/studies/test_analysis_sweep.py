"""The overlap sweep end to end on a tiny letter task (a few training steps), and its config checks."""

from __future__ import annotations

import json

import pytest
import yaml

from mergecompose.cli import main
from mergecompose.core.io import load_yaml_config
from mergecompose.studies.letters.overlap_sweep import SweepConfig, allowed_outputs, joint_accuracy

TINY_COMPARE = {
    "name": "tiny",
    "task": {"formulation": "seq2seq", "alphabet": "ABCDEFGH ", "train_lengths": [1, 6]},
    "positions": {"scheme": "coupled", "randomize": True, "max_position": 32},
    "model": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "max_position_embeddings": 32},
    "training": {
        "seed": 0,
        "base": {"steps": 20, "batch_size": 16, "lr": 0.01},
        "experts": {"init": "base", "full": {"steps": 5, "batch_size": 16, "lr": 0.01}},
    },
    "evaluation": {"lengths": [6], "batch_size": 64},
}


def test_allowed_outputs_and_joint_accuracy_golden():
    assert allowed_outputs("ACX", {"A": "B"}, {"C": "D"}) == [{"B"}, {"D"}, {"X"}]
    assert allowed_outputs("AC", {"A": "B"}, {"A": "C"}) == [{"B", "C"}, {"C"}]
    outputs = ["BD", "DB", "B", "CD…"]
    assert joint_accuracy(outputs, ["AC", "AC", "AC", "AC"], {"A": "B"}, {"C": "D"}) == 0.25
    assert joint_accuracy(["CX", "BX", "AX"], ["AX"] * 3, {"A": "B"}, {"A": "C"}) == pytest.approx(2 / 3)


def test_sweep_config_rejects_unknown_skills_and_all_conflicting_pairs(tmp_path):
    with pytest.raises(ValueError, match="does not define"):
        SweepConfig(compare="x.yaml", skills={"ab": {"A": "B"}}, pairs=[("ab", "cd")])
    compare = tmp_path / "compare.yaml"
    compare.write_text(yaml.safe_dump(TINY_COMPARE))
    config = SweepConfig(compare=str(compare), skills={"ab": {"A": "B"}, "ac": {"A": "C"}}, pairs=[("ab", "ac")])
    with pytest.raises(ValueError, match="do not conflict"):
        config.compare_config()


def test_tiny_sweep_end_to_end(tmp_path, capsys):
    compare = tmp_path / "compare.yaml"
    compare.write_text(yaml.safe_dump(TINY_COMPARE))
    sweep = {
        "name": "tiny_sweep",
        "compare": str(compare),
        "skills": {"ab": {"A": "B"}, "cd": {"C": "D"}, "ac": {"A": "C"}},
        "pairs": [["ab", "cd"], ["ab", "ac"], ["cd", "ac"]],
        "test_strings": 16,
        "validation_strings": 8,
        "merges": {"task_arithmetic": {"lam": [1.0]}, "ties": {"lam": [1.0], "density": [0.5]}},
        "settings": {"reservoir_size": 2, "heatmap_sequences": 1},
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    assert load_yaml_config(path, SweepConfig, "sweep config").pairs == [("ab", "cd"), ("ab", "ac"), ("cd", "ac")]
    out = tmp_path / "run"
    assert main(["overlap-sweep", str(path), "--out", str(out), "--quiet"]) == 0
    assert "Spearman mass_overlap vs compose_error" in capsys.readouterr().out
    for name in ["sweep.json", "sweep.md", "config.yaml", "overlap_vs_error.png", "overlap_weighted_vs_error.png"]:
        assert (out / name).stat().st_size > 0
    results = json.loads((out / "sweep.json").read_text())
    rows = {row["pair"]: row for row in results["rows"]}
    assert list(rows) == ["ab+cd", "ab+ac", "cd+ac"]
    assert rows["ab+ac"]["conflict"] and not rows["ab+cd"]["conflict"]
    for row in rows.values():
        assert 0 <= row["compose_accuracy"] <= 1 and 0 <= row["merge_accuracy"] <= 1
        assert 0 <= row["mass_overlap"] <= 1 and row["linearization_error"] >= 0
    assert results["statistics"]["spearman"]["mass_overlap vs compose_error"]["n"] == 3
    assert sum(cell["n"] for cell in results["statistics"]["two_by_two"]["cells"].values()) == 3
    # Every candidate merge was scored on validation; the chosen one is the best.
    record = results["pairs"]["ab+cd"]
    assert len(record["merge_validation"]) == 2
    assert record["merge_chosen"]["validation"] == max(c["validation"] for c in record["merge_validation"])
    # The first run trained every component; a sweep of another config in the folder is refused.
    again = json.loads(json.dumps(results["training"]))
    assert all(not entry["cached"] for entry in again.values())
    sweep["test_strings"] = 8
    path.write_text(yaml.safe_dump(sweep))
    assert main(["overlap-sweep", str(path), "--out", str(out), "--quiet"]) == 2
    assert "another config" in capsys.readouterr().err


def test_conflict_choices_count_the_letters_written_on_conflicts():
    from mergecompose.studies.letters.overlap_sweep import conflict_choices

    counts = conflict_choices(["BXC", "", "AXA"], ["AXA", "AX", "AXA"], {"A": "B"}, {"A": "C"})
    assert counts == {"A": 2, "B": 1, "C": 1, "<none>": 1}
    assert conflict_choices(["BD"], ["AC"], {"A": "B"}, {"C": "D"}) == {}
