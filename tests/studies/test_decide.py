"""`mergecompose decide` end to end on tiny models (a character tokenizer saved with the base): the choices on
validation, the label the sequential rule gives on the logged test items, the budget, the resume after a kill,
full and LoRA experts; and the task file and its scorers."""

from __future__ import annotations

import json

import pytest

from mergecompose.analysis.data import char_tokenizer
from mergecompose.analysis.sequential_decision import DecisionSettings, decide_sequence
from mergecompose.cli import main
from mergecompose.core.tiny import random_lora_adapter
from mergecompose.studies.decide.joint_task import joint_task_records, load_scorer, read_task, skill_item
from mergecompose.studies.skill_pairs.skill_data import joint_items
from mergecompose.studies.skill_pairs.skill_scoring import score_item

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ01234567"  # + 4 special tokens = 64 ids
SCORER = '''
def has_reference(prompt, output, reference):
    """Right when the output holds the reference character."""
    return reference in output
'''


@pytest.fixture(scope="module")
def folder(tmp_path_factory, base_model, expert_models):
    """base/ (with a character tokenizer), two LoRA adapters, two full experts, a task and a scorer module."""
    root = tmp_path_factory.mktemp("decide")
    base_model.save_pretrained(root / "base")
    char_tokenizer(CHARACTERS).save_pretrained(root / "base")
    for index, model in enumerate(expert_models):
        model.save_pretrained(root / f"full_{index}")
    random_lora_adapter(base_model, root / "lora_a", seed=21)
    random_lora_adapter(base_model, root / "lora_b", seed=22)
    lines = [{"prompt": CHARACTERS[i % 26] * 3, "reference": CHARACTERS[(7 * i) % 26]} for i in range(40)]
    (root / "task.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (root / "grid.yaml").write_text("merges:\n  task_arithmetic: {lam: [0.5, 1.0]}\nweights: [1.0]\nremedies: {}\n")
    (root / "tiny_scorer.py").write_text(SCORER)
    return root


def decide(folder, out, *extra, experts=("lora_a", "lora_b")):
    argv = ["decide", "--base", str(folder / "base"), "--task", str(folder / "task.jsonl")]
    for expert in experts:
        argv += ["--expert", str(folder / expert)]
    argv += ["--scorer", "tiny_scorer:has_reference", "--validation", "6", "--grid", str(folder / "grid.yaml")]
    return main([*argv, "--max-new-tokens", "6", "--out", str(out), "--quiet", *extra])


def logged(out) -> list[dict]:
    return [json.loads(line) for line in (out / "test_items.jsonl").read_text().splitlines()]


def test_the_label_is_the_rule_on_the_logged_items(folder, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(folder))
    assert decide(folder, tmp_path / "run") == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    rows = logged(tmp_path / "run")
    assert results["test_items_available"] == 34 and results["validation"]["items"] == 6
    used = results["test_items_used"]
    expected = decide_sequence([r["merge"]["right"] for r in rows], [r["compose"]["right"] for r in rows])
    assert (results["label"], used, results["budget_reached"]) == (
        expected.label,
        expected.items,
        expected.budget_reached,
    )
    assert results["decision"]["merge_right"] == sum(r["merge"]["right"] for r in rows[:used])
    # The choices: the first of the highest validation accuracies, in grid order.
    for kind in ("merge", "compose"):
        scores = results["validation"][kind]
        assert results["chosen"][kind] == max(scores, key=scores.get)
    assert list(results["validation"]["merge"]) == ["merge:task_arithmetic@lam=0.5", "merge:task_arithmetic@lam=1"]
    assert all(row["systems"] == results["chosen"] for row in rows)
    assert "# Merge or compose:" in (tmp_path / "run" / "results.md").read_text()


def test_the_budget_and_a_resume_after_a_kill(folder, tmp_path, monkeypatch):
    """--max-items 5 stops at the budget with the fixed-n label; a half-written line (a kill) is dropped, and a
    larger budget goes on from the log without answering its items again."""
    monkeypatch.syspath_prepend(str(folder))
    out = tmp_path / "run"
    assert decide(folder, out, "--max-items", "5") == 0
    first = json.loads((out / "results.json").read_text())
    assert first["test_items_used"] == 5 and first["budget_reached"]
    rows = logged(out)
    budget = decide_sequence(
        [r["merge"]["right"] for r in rows], [r["compose"]["right"] for r in rows], DecisionSettings(max_items=5)
    )
    assert first["label"] == budget.label
    rows[0]["merge"]["output"] = "kept from the first run"  # a mark that a second answer would overwrite
    text = "".join(json.dumps(row) + "\n" for row in rows) + '{"prompt": "aaa", "systems": '  # killed while writing
    (out / "test_items.jsonl").write_text(text)
    assert decide(folder, out, "--max-items", "12") == 0
    second = json.loads((out / "results.json").read_text())
    again = logged(out)
    assert again[: len(rows)] == rows  # kept, not answered again
    assert second["test_items_used"] == 12 and len(again) >= 12


def test_full_checkpoints_as_experts(folder, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(folder))
    assert decide(folder, tmp_path / "run", "--max-items", "3", experts=("full_0", "full_1")) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["test_items_used"] == 3 and results["label"] in ("merge", "compose", "either", "neither")


def test_the_skills_scorer_reads_the_joint_task_records(tmp_path):
    records = joint_task_records("units", "json", "test", 5)
    items = joint_items("units", "json", "test", 5)
    path = tmp_path / "task.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    score, check = load_scorer("skills")
    read = read_task(path, "--task", check)
    assert [item.prompt for item in read] == [item.prompt for item in items]
    for item, task_item in zip(items, read):
        assert skill_item(task_item.prompt, task_item.reference) == item
        assert (
            score(task_item.prompt, item.answer, task_item.reference) is score_item(item, item.answer).lenient is True
        )
        assert score(task_item.prompt, "no answer", task_item.reference) is False
    strict, _ = load_scorer("skills-strict")
    assert strict(read[0].prompt, items[0].answer, read[0].reference)


def test_exact_and_a_users_scorer(tmp_path, monkeypatch):
    exact, check = load_scorer("exact")
    assert exact("p", " 42\n", "42") and not exact("p", "42 apples", "42")
    with pytest.raises(ValueError, match="an `exact` reference must be a string"):
        check(42)
    (tmp_path / "my_scorer.py").write_text(
        "def score(prompt, output, reference):\n    return output == reference[::-1]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    user, user_check = load_scorer("my_scorer:score")
    assert user("p", "cba", "abc") and user_check is None


def test_a_scorer_that_answers_other_than_a_bool_is_named(folder, tmp_path, monkeypatch, capsys):
    (tmp_path / "loose_scorer.py").write_text("def score(prompt, output, reference):\n    return 'yes'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["decide", "--base", str(folder / "base"), "--task", str(folder / "task.jsonl"), "--validation", "6"]
    argv += ["--expert", str(folder / "lora_a"), "--expert", str(folder / "lora_b")]
    argv += ["--grid", str(folder / "grid.yaml")]
    argv += ["--scorer", "loose_scorer:score", "--max-new-tokens", "2", "--out", str(tmp_path / "run"), "--quiet"]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "`--scorer` 'loose_scorer:score' must return True or False, got 'yes'" in error[0]
