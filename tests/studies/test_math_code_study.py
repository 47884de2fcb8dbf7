"""The real-model study (`task.type: math_code`), scaled down: the real SmolLM2, two experts trained for two steps,
one item per split, every kind of system, lm-eval's `hf` and `composed` models, the sandbox, the diagnostics.

The study's own model cache (`MERGECOMPOSE_CACHE`) is a temporary folder here, and the base is given as the
session's converted SmolLM2 folder, so the user's cache is left alone.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergecompose.analysis.predict import UNDECIDED, VERDICTS
from mergecompose.core.sandbox import sandbox_available
from mergecompose.experiments.compare_config import load_config
from mergecompose.integrations.lm_eval.humaneval import TASK_NAMES as HUMANEVAL_TASKS
from mergecompose.studies.math_code import code_split, score_code
from mergecompose.studies.math_code import experts as experts_module
from mergecompose.studies.math_code.experts import (
    ExpertRecipe,
    expert_folder,
    recipe_key,
    resolved,
    sampled_pairs,
    training_pairs,
)
from mergecompose.studies.math_code.lm_eval_tasks import study_records
from mergecompose.studies.math_code.math_problems import PROCEDURAL, math_split
from mergecompose.studies.math_code.study import (
    SPLITS,
    MathCodeStudyConfig,
    StudySplits,
    paper_table,
    run_math_code_study,
)

pytestmark = pytest.mark.skipif(sandbox_available() is not None, reason=f"no code sandbox: {sandbox_available()}")

SYSTEMS = [
    "base",
    "expert:math",
    "expert:code",
    "compose",
    "compose+gate",
    "compose+shared_delta",
    "merge:linear",
    "merge:task_arithmetic",
    "merge:ties",
    "merge:dare_ties",
]


def study_fields(base: str) -> dict:
    return {
        "name": "study_scaled_down",
        "task": {"type": "math_code"},
        "base": base,
        "experts": {
            "math": {"skill": "math", "examples": 4, "steps": 2, "batch_size": 2, "rank": 4, "alpha": 8},
            "code": {"skill": "code", "examples": 4, "steps": 2, "batch_size": 2, "rank": 4, "alpha": 8},
        },
        "compositions": {
            "compose": {"experts": ["math", "code"]},
            "compose+gate": {"experts": ["math", "code"], "remedies": {"gate": 0.1}},
            "compose+shared_delta": {"experts": ["math", "code"], "remedies": {"shared_delta": True}},
        },
        "merges": {
            "linear": {},
            "task_arithmetic": {"lam": [0.5, 1.0]},
            "ties": {"lam": [1.0], "density": [0.5]},
            "dare_ties": {"lam": [1.0], "drop_rate": [0.5]},
        },
        "splits": {
            "math": 1,
            "code": 1,
            "mixed": 1,
            "validation": 2,
            "humaneval": False,  # through lm-eval on the real model: tests/integrations/lm_eval/test_humaneval_real.py
            "limit": 1,
            "gen_kwargs": {"max_gen_toks": 8},
        },
        "diagnostics": {"prompts": 2, "max_new_tokens": 4, "batch_size": 2},
        "batch_size": 2,
        "dtype": "auto",  # as the shipped config: bfloat16 where the CPU has fast bfloat16 kernels
        "threads": torch.get_num_threads(),
        "allow_code_execution": True,
    }


@pytest.fixture(scope="module")
def study(smollm2_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("study_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MERGECOMPOSE_CACHE", str(cache))
        config = MathCodeStudyConfig.model_validate(study_fields(str(smollm2_dir)))
        out = tmp_path_factory.mktemp("study") / "out"
        results = run_math_code_study(config, out, progress=False, echo=None)
        again = run_math_code_study(config, out, progress=False, echo=None)
    return {"config": config, "out": out, "results": results, "again": again, "cache": cache}


def test_every_system_is_scored_on_every_split_with_both_scores(study):
    results = study["results"]
    assert list(results["systems"]) == SYSTEMS
    for system, splits in results["systems"].items():
        for split, (task, prefix, _, _) in SPLITS.items():
            if split.startswith("humaneval"):
                assert not any(key.startswith(task) for key in splits)
                continue
            strict, lenient = splits[f"{task}/{prefix}strict"], splits[f"{task}/{prefix}lenient"]
            assert strict["n"] == lenient["n"] == 1, (system, split)
            assert 0 <= strict["value"] <= lenient["value"] <= 1, (system, split)
            low, high = lenient["ci95"]
            assert low <= lenient["value"] <= high


def test_the_experts_are_trained_from_the_base_and_kept_by_recipe(study, smollm2_dir):
    training = study["results"]["training"]
    for name, recipe in study["config"].experts.items():
        folder = expert_folder(str(smollm2_dir), recipe, study["cache"])
        assert training[name]["folder"] == str(folder)
        adapter = json.loads((folder / "adapter_config.json").read_text())
        assert adapter["r"] == 4 and sorted(adapter["target_modules"]) == sorted(recipe.target_modules)
        record = json.loads((folder / "training.json").read_text())
        assert len(record["losses"]) == recipe.steps and all(loss > 0 for loss in record["losses"])
    changed = ExpertRecipe.model_validate({**study["config"].experts["math"].model_dump(), "steps": 3})
    assert expert_folder(str(smollm2_dir), changed, study["cache"]) != training["math"]["folder"]


def test_merges_are_chosen_on_validation_items_only(study):
    merges = study["results"]["merges"]
    chosen = merges["task_arithmetic"]
    assert [entry["params"] for entry in chosen["validation"]] == [{"lam": 0.5}, {"lam": 1.0}]
    assert chosen["selected_on"] == {"task": "mc_validation", "split": None, "limit": 2}
    assert chosen["chosen"] in ([{"lam": 0.5}, {"lam": 1.0}][i] for i in range(2))
    validation = study_records({"math": 1, "code": 1, "mixed": 1, "validation": 2})["mc_validation"]
    assert {record["problem"]["split"] for record in validation} == {"validation"}
    assert [record["kind"] for record in validation] == ["math", "code"]


def test_the_outputs_are_written(study):
    out = study["out"]
    for name in ("results.json", "results.md", "study.png", "config.yaml", "lm_eval/results.json"):
        assert (out / name).is_file(), name
    markdown = (out / "results.md").read_text()
    assert "HumanEval (not +)" in markdown and "MBPP+: 39.4 vs 38.1" in markdown and "GSM8K / MATH" in markdown
    samples = out / "lm_eval" / "samples" / "compose" / "mc_mixed.jsonl"
    sample = json.loads(samples.read_text().splitlines()[0])
    assert sample["doc"]["kind"] == "mixed" and "<|im_start|>assistant\n" in sample["arguments"][0][0]
    reloaded = load_config(out / "config.yaml")
    assert reloaded == study["config"]
    # Without compositions the paper-shaped table takes n from the reference system.
    results = json.loads((out / "results.json").read_text())
    n = results["systems"]["expert:math"]["mc_math/lenient"]["n"]
    alone = {**results, "config": {**results["config"], "compositions": {}}}
    assert f"math, held out ({n})" in paper_table(alone, "lenient")


def test_the_diagnostics_measure_coactivation_at_each_epsilon_and_recommend(study):
    diagnostics = study["results"]["diagnostics"]
    rates = diagnostics["teacher_forced"]["coactivation_by_epsilon"]
    assert sorted(rates, key=float) == ["0.01", "0.1", "1.0"]
    values = [rates[key] for key in ("0.01", "0.1", "1.0")]
    assert all(0 <= value <= 1 for value in values) and values == sorted(values, reverse=True)
    assert diagnostics["recommendation"]["verdict"] in (*VERDICTS, UNDECIDED)
    verdict = study["results"]["verdict"]
    assert verdict["outcome"] in ("compose", "merge", "either")


def test_a_rerun_trains_and_evaluates_nothing(study):
    again = study["again"]
    assert all(record["cached"] for record in again["training"].values())
    lm_eval = json.loads((study["out"] / "lm_eval" / "results.json").read_text())
    assert lm_eval["cells"]["evaluated"] == []
    assert again["systems"] == study["results"]["systems"]


def test_a_config_without_the_code_execution_opt_in_is_refused_before_any_work(smollm2_dir, tmp_path):
    fields = {**study_fields(str(smollm2_dir)), "allow_code_execution": False}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(fields))
    with pytest.raises(ValueError, match="allow_code_execution: true"):
        load_config(path)
    assert sorted(item.name for item in tmp_path.iterdir()) == ["study.yaml"]


def test_the_shipped_configs_load(smollm2_dir):
    for name in ("smollm2_math_code.yaml", "smollm2_math_code_full.yaml"):
        config = load_config(f"configs/{name}")
        assert isinstance(config, MathCodeStudyConfig) and config.allow_code_execution
    full = load_config("configs/smollm2_math_code_full.yaml")
    assert {recipe.kind for recipe in full.experts.values()} == {"full"}
    assert full.splits.mixed == 0 and not full.splits.humaneval


def test_humaneval_protocols_choose_which_humaneval_tasks_run():
    written = ["mc_math", "mc_code", "mc_mixed", "mc_validation", *HUMANEVAL_TASKS]
    assert StudySplits().task_names(written) == ["mc_math", "mc_code", "mc_mixed", *HUMANEVAL_TASKS]
    instruct = StudySplits(humaneval_protocols=["instruct"]).task_names(written)
    assert instruct == ["mc_math", "mc_code", "mc_mixed", "humaneval_sandbox_instruct"]
    assert StudySplits(humaneval_protocols=["completion"]).task_names(written)[-1] == "humaneval_sandbox_completion"
    for bad in ([], ["instruct", "instruct"], ["plus"]):
        with pytest.raises(ValueError, match="humaneval_protocols"):
            StudySplits(humaneval_protocols=bad)


def test_sampled_answers_keep_only_the_bases_right_answers(smollm2_dir):
    """`answers: sampled` (rejection sampling): every kept answer is one of the base's draws and passes its tests."""
    recipe = ExpertRecipe(skill="code", examples=4, answers="sampled", samples=2, max_new_tokens=64, seed=3)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    try:
        pairs, counts = sampled_pairs(model, tokenizer, recipe, batch_size=8)
    except ValueError as error:  # a base that solves none of them is refused, not trained on nothing
        assert "none of the base's 8 answers to 4 code problems is right" in str(error)
        return
    problems = {problem.prompt: problem for problem in code_split("train", 4, seed=3)}
    assert counts["drawn"] == 8 and 1 <= counts["kept"] == len(pairs) <= counts["right"] <= 8
    scores = score_code([answer for _, answer in pairs], [problems[prompt] for prompt, _ in pairs])
    assert all(score.lenient for score in scores)


def test_an_expert_is_kept_by_its_training_data_too(tmp_path, monkeypatch):
    """A changed data generator trains anew: the cache key holds the training problems, not only the recipe."""
    recipe = ExpertRecipe(skill="math", examples=3, steps=1)
    folder = expert_folder(tmp_path, recipe, tmp_path / "cache")
    assert expert_folder(tmp_path, recipe, tmp_path / "cache") == folder
    assert expert_folder(tmp_path, recipe.model_copy(update={"arithmetic": "expanded"}), tmp_path / "cache") != folder
    monkeypatch.setattr(experts_module, "training_pairs", lambda recipe: [("Another problem?", "The answer is 1.")])
    assert expert_folder(tmp_path, recipe, tmp_path / "cache") != folder
    with pytest.raises(ValueError, match=r"`arithmetic` must be 'direct' for a code expert, got 'expanded'"):
        ExpertRecipe(skill="code", arithmetic="expanded")
    with pytest.raises(ValueError, match=r"`procedural_weight` must be 1 for a code expert, got 3"):
        ExpertRecipe(skill="code", procedural_weight=3)


def test_types_weight_adds_the_problem_types_template_to_the_math_train_split():
    """Weight 0 is the split as before; weight w adds `problem_types` w times a turn to the 16 train templates."""
    plain = ExpertRecipe(skill="math", examples=160)
    typed = plain.model_copy(update={"types_weight": 8})
    assert math_split("train", 160, 0, 1, 0) == math_split("train", 160)
    templates = [p.template for p in math_split("train", 480, 0, 1, 8)]
    assert 0.3 < templates.count("problem_types") / len(templates) < 0.36  # 8 of every 24 draws
    assert set(templates) == {p.template for p in math_split("train", 160)} | {"problem_types"}
    assert [prompt for prompt, _ in training_pairs(typed)] == [p.prompt for p in math_split("train", 160, 0, 1, 8)]
    assert expert_folder("base", typed, "cache") != expert_folder("base", plain, "cache")
    assert "types_weight" not in recipe_key(plain) and recipe_key(typed)["types_weight"] == 8
    with pytest.raises(ValueError, match=r"`types_weight` must be 0 for the validation split"):
        math_split("validation", 5, types_weight=1)
    with pytest.raises(ValueError, match=r"`types_weight` must be an integer >= 0, got -1"):
        math_split("train", 5, types_weight=-1)
    with pytest.raises(ValueError, match=r"`types_weight` must be 0 for a code expert, got 2"):
        ExpertRecipe(skill="code", types_weight=2)


def test_procedural_weight_sets_the_share_of_procedural_math_problems():
    """Weight 1 is the split as before; weight w takes each procedural template w times a turn."""
    plain = ExpertRecipe(skill="math", examples=160)
    weighted = plain.model_copy(update={"procedural_weight": 6})
    assert training_pairs(plain) == [(p.prompt, p.solution) for p in math_split("train", 160)]
    templates = [p.template for p in math_split("train", 360, 0, 6)]
    share = sum(template in {t.__name__ for t in PROCEDURAL} for template in templates) / len(templates)
    assert 0.6 < share < 0.7  # 24 of every 36 draws (a repeated question is drawn again), against 4 of 16
    assert set(templates) == {p.template for p in math_split("train", 160)}  # no template dropped
    assert [prompt for prompt, _ in training_pairs(weighted)] == [p.prompt for p in math_split("train", 160, 0, 6)]
    assert expert_folder("base", weighted, "cache") != expert_folder("base", plain, "cache")
    # An expert cached before the field existed keeps its key: the default is left out of it.
    assert "procedural_weight" not in recipe_key(plain) and recipe_key(weighted)["procedural_weight"] == 6
    assert {**recipe_key(plain), "procedural_weight": 1, "types_weight": 0} == resolved(plain).model_dump(mode="json")
    with pytest.raises(ValueError, match=r"`procedural_weight` must be 1 for the test split"):
        math_split("test", 5, procedural_weight=2)
    with pytest.raises(ValueError, match=r"`procedural_weight` must be an integer >= 1, got 0"):
        math_split("train", 5, procedural_weight=0)
