"""One real setting end to end on SmolLM2, scaled down: choice on validation, test cells, the label, the cache.

The two experts are the suite's SmolLM2 adapters (`smollm2_adapters`, a few steps each) standing in for the
units and json experts: the mechanics are under test here, not the skills.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergecompose.composition.remedies import RemedySettings
from mergecompose.studies.math_code.chat_data import generation_inputs
from mergecompose.studies.predict.paired_outcome import paired_outcome
from mergecompose.studies.skill_pairs.setting_run import SettingRun, model_answers
from mergecompose.studies.skill_pairs.skill_data import joint_items
from mergecompose.studies.skill_pairs.skill_scoring import score_item

MERGES = {"task_arithmetic": [{"lam": 0.5}, {"lam": 1.0}]}
WEIGHTS = [1.0]
REMEDIES = {"gate": RemedySettings(gate=0.1)}


@pytest.fixture(scope="module")
def setting(smollm2_dir, smollm2_adapters, tmp_path_factory):
    folder = tmp_path_factory.mktemp("setting")
    experts = {"units": smollm2_adapters["math"], "json": smollm2_adapters["code"]}
    run = SettingRun(smollm2_dir, experts, folder, max_new_tokens=12, batch_size=4, progress=False)
    validation = joint_items("units", "json", "validation", 3)
    test = joint_items("units", "json", "test", 5)
    return run, validation, test, run.run(validation, test, MERGES, WEIGHTS, REMEDIES)


def test_the_choice_is_the_best_validation_accuracy(setting):
    run, validation, test, result = setting
    merge_scores = result["chosen"]["merge"]["validation"]
    assert list(merge_scores) == ["merge:task_arithmetic@lam=0.5", "merge:task_arithmetic@lam=1"]
    compose_scores = result["chosen"]["compose"]["validation"]
    assert list(compose_scores) == ["compose@1", "compose+gate"]
    for kind, scores in (("merge", merge_scores), ("compose", compose_scores)):
        best = max(scores.values())
        assert result["chosen"][kind]["system"] == next(name for name, score in scores.items() if score == best)


def test_the_test_cells_and_the_label(setting):
    run, validation, test, result = setting
    merge, compose = result["chosen"]["merge"]["system"], result["chosen"]["compose"]["system"]
    assert set(result["test"]) == {"base", "expert:units", "expert:json", merge, compose}
    cells = {}
    for name in result["test"]:
        cell = json.loads((run.folder / "cells" / f"{name}--test.json").read_text())
        assert cell["prompts"] == [item.prompt for item in test]
        rescored = [score_item(item, output).lenient for item, output in zip(test, cell["outputs"])]
        assert cell["right"] == rescored
        assert result["test"][name]["accuracy"] == sum(rescored) / len(test)
        cells[name] = cell
    expected = paired_outcome(cells[merge]["right"], cells[compose]["right"]).to_dict()
    assert result["outcome"] == expected


def test_the_base_cell_is_plain_greedy_generation(setting, smollm2_dir):
    run, validation, test, result = setting
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    prompts = [item.prompt for item in test[:2]]
    inputs = generation_inputs(tokenizer, prompts)
    out = model.generate(**inputs, do_sample=False, max_new_tokens=12, pad_token_id=2, eos_token_id=2)
    expected = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    cell = json.loads((run.folder / "cells" / "base--test.json").read_text())
    assert cell["outputs"][:2] == expected
    assert model_answers(run.base, tokenizer, prompts, 12, 2) == expected  # the base is itself after the compositions


def test_a_rerun_reads_every_cell_from_the_cache(setting, monkeypatch):
    run, validation, test, result = setting

    def refuse(*args, **kwargs):
        raise AssertionError("a cached cell was built again")

    monkeypatch.setattr(run, "merged_model", refuse)
    monkeypatch.setattr(run, "composed", refuse)
    monkeypatch.setattr(run, "expert_model", refuse)
    assert run.run(validation, test, MERGES, WEIGHTS, REMEDIES) == result
