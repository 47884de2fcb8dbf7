"""The deep pre-flight of `type: lm_eval` compares, relative paths read from the config's folder, and `--quiet`
silencing lm-eval. Tiny checkpoints and tiny local tasks only: no training, lm-eval's own task index never built."""

from __future__ import annotations

import json
import os
import subprocess

import lm_eval
import pytest
import torch
import yaml
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from mergecompose.analysis.data import char_tokenizer
from mergecompose.cli import main
from mergecompose.core.tiny import random_llama, tiny_llama_config
from mergecompose.experiments.compare_config import load_config
from mergecompose.experiments.lm_eval import LmEvalCompareConfig
from mergecompose.experiments.lm_eval.cells import CellSettings, CellStore, TaskRun
from mergecompose.experiments.lm_eval.lm_eval_compare import run_lm_eval_compare
from mergecompose.experiments.lm_eval.lm_eval_config import resolve_source
from mergecompose.experiments.lm_eval.native_run import write_choice_task, write_generate_task
from mergecompose.experiments.lm_eval.preflight import check_before_work, check_device
from mergecompose.experiments.scored_systems import System

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def project(base_model, tmp_path_factory):
    """project/models/{base,expert,big_vocabulary}, project/tasks/ (one generate, one choice task)."""
    root = tmp_path_factory.mktemp("project")
    tokenizer = char_tokenizer("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456 ")  # vocab 64
    for name, model in [("base", base_model), ("expert", random_llama(tiny_llama_config(), seed=3))]:
        model.save_pretrained(root / "models" / name)
        tokenizer.save_pretrained(root / "models" / name)
    random_llama(tiny_llama_config(vocab_size=80), seed=4).save_pretrained(root / "models" / "big_vocabulary")
    write_generate_task(root / "tasks", "tiny_gen", [("AB", "BB"), ("CD", "DD")], 4)
    write_choice_task(root / "tasks", "tiny_choice", [("AB", ["BB", "AB"], 0), ("CD", ["CD", "DD"], 1)])
    return root


def _data(project, **changes) -> dict:
    return {
        "task": {"type": "lm_eval", "names": ["tiny_gen"], "include_path": str(project / "tasks")},
        "base": str(project / "models" / "base"),
        "experts": {"expert": str(project / "models" / "expert")},
        **changes,
    }


def _files(folder) -> dict[str, int]:
    return {str(path): path.stat().st_mtime_ns for path in folder.rglob("*")}


def test_relative_paths_are_read_from_the_config_folder(project, tmp_path, monkeypatch):
    configs = project / "configs"
    configs.mkdir(exist_ok=True)
    data = {
        "task": {"type": "lm_eval", "names": ["tiny_gen"], "include_path": "../tasks"},
        "base": "../models/base",
        "experts": {"expert": "../models/expert", "hub": "mergecompose-tests/not-a-cached-model"},
    }
    (configs / "relative.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)  # anywhere but the config's folder
    config = load_config(project / "configs" / "relative.yaml")
    assert config.task.include_path == str(project / "tasks")
    assert config.base == str(project / "models" / "base")
    assert config.experts == {"expert": str(project / "models" / "expert"), "hub": data["experts"]["hub"]}
    assert resolve_source("google/gemma-2-2b", configs) == "google/gemma-2-2b"  # a hub id stays a hub id
    # Validated from a dict, relative paths are the working directory's, as before.
    monkeypatch.chdir(project)
    assert LmEvalCompareConfig.model_validate(_data(project, base="models/base")).base == str(project / "models/base")


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        (
            "task: broken\ndataset_path: json\noutput_type: generate\n",
            r"`output_type` must be one of \[.*got 'generate'",
        ),
        ("task: broken\ndataset_path: json\noutput_type: [unclosed\n", r"cannot be read as YAML"),
        ("task: broken\noutput_type: loglikelihood\n", r"`dataset_path` is missing"),
        ("task: broken\ndataset_path: json\noutput_type: multiple_choice\n", r"needs `doc_to_choice`"),
        ("task: broken\ndataset_path: json\nmetric_list: [acc]\n", r"`metric_list` must be a list of mappings"),
        ("- not a mapping\n", r"must be a mapping of task settings, got list"),
    ],
)
def test_a_bad_task_file_is_named_with_its_field(project, tmp_path, yaml_text, message):
    tasks = tmp_path / "tasks"
    write_generate_task(tasks, "tiny_gen", [("AB", "BB")], 4)
    (tasks / "broken.yaml").write_text(yaml_text)
    with pytest.raises(ValueError, match=r"task file '.*broken\.yaml'.*" + message):
        LmEvalCompareConfig.model_validate(
            _data(project, task={"type": "lm_eval", "names": ["tiny_gen"], "include_path": str(tasks)})
        )


def test_a_function_tag_and_an_include_are_read_as_lm_eval_reads_them(project, tmp_path):
    tasks = tmp_path / "tasks"
    write_generate_task(tasks, "tiny_gen", [("AB", "BB")], 4)
    (tasks / "_template").write_text("dataset_path: json\noutput_type: multiple_choice\n")
    (tasks / "derived.yaml").write_text("include: _template\ntask: derived\ndoc_to_choice: !function utils.choices\n")
    config = LmEvalCompareConfig.model_validate(
        _data(project, task={"type": "lm_eval", "names": ["tiny_gen"], "include_path": str(tasks)})
    )
    check_before_work(config)  # nothing imported, nothing refused
    (tasks / "_template").write_text("dataset_path: json\noutput_type: multiple_choice_typo\n")
    with pytest.raises(ValueError, match=r"derived\.yaml'.*`output_type`"):
        check_before_work(config)


def test_the_selection_metric_must_be_one_the_task_reports(project):
    selection = {"task": "tiny_gen", "metric": "exact_match"}
    data = _data(project, merges={"task_arithmetic": {"lam": [0.5, 1.0]}}, merge_selection=selection)
    check_before_work(LmEvalCompareConfig.model_validate(data))
    data["merge_selection"] = {"task": "tiny_gen", "metric": "accuracy"}
    with pytest.raises(
        ValueError, match=r"`merge_selection.metric` 'accuracy' is not a metric of task 'tiny_gen'; it reports \['exact"
    ):
        check_before_work(LmEvalCompareConfig.model_validate(data), "my.yaml")


def test_generation_settings_the_composed_model_does_not_support(project, tmp_path):
    compositions = {"compose": {"experts": ["expert"]}}
    task = {"type": "lm_eval", "names": ["tiny_gen"], "include_path": str(project / "tasks")}
    ok = {**task, "gen_kwargs": {"do_sample": False, "max_gen_toks": 3}}
    check_before_work(LmEvalCompareConfig.model_validate(_data(project, task=ok, compositions=compositions)))
    bad = {**task, "gen_kwargs": {"num_beams": 4, "do_sample": False}}
    config = LmEvalCompareConfig.model_validate(_data(project, task=bad, compositions=compositions))
    with pytest.raises(ValueError, match=r"`task.gen_kwargs` \['num_beams'\] are not supported .*supported: \["):
        check_before_work(config)
    check_before_work(LmEvalCompareConfig.model_validate(_data(project, task=bad)))  # `hf` alone takes them
    tasks = tmp_path / "tasks"
    write_generate_task(tasks, "beams", [("AB", "BB")], 4)
    text = (tasks / "beams.yaml").read_text().replace("do_sample: false", "do_sample: false\n  num_beams: 2")
    (tasks / "beams.yaml").write_text(text)
    task = {"type": "lm_eval", "names": ["beams"], "include_path": str(tasks)}
    with pytest.raises(ValueError, match=r"task 'beams' sets `generation_kwargs` \['num_beams'\]"):
        check_before_work(LmEvalCompareConfig.model_validate(_data(project, task=task, compositions=compositions)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_on_a_machine_without_it_is_refused_at_once(project):
    with pytest.raises(ValueError, match=r"`device` is 'cuda' but this machine has no CUDA device .*set `device: cpu`"):
        check_before_work(LmEvalCompareConfig.model_validate(_data(project, device="cuda")))
    check_device("cpu")


def test_an_expert_of_another_vocabulary_is_named_with_its_path(project):
    experts = {"expert": str(project / "models" / "expert"), "big": str(project / "models" / "big_vocabulary")}
    data = _data(project, experts=experts, compositions={"compose": {"experts": ["expert", "big"]}})
    before = _files(project)
    with pytest.raises(
        ValueError, match=r"expert 'big' \('.*big_vocabulary', used in composition 'compose'\) has a vocabulary of 80"
    ):
        check_before_work(LmEvalCompareConfig.model_validate(data))
    check_before_work(LmEvalCompareConfig.model_validate(_data(project, experts=experts)))  # scored alone: fine
    assert _files(project) == before  # nothing written


def test_quiet_silences_lm_eval(project, tmp_path, monkeypatch, capfd):
    """progress=False (`--quiet`): no log line, no bar, no `fatal: not a git repository` from lm-eval's git call."""
    outside_git = tmp_path / "outside"
    outside_git.mkdir()
    monkeypatch.chdir(outside_git)
    assert subprocess.run(["git", "rev-parse"], capture_output=True).returncode != 0  # so git would complain
    task = {"type": "lm_eval", "names": ["tiny_choice"], "include_path": str(project / "tasks")}
    config = LmEvalCompareConfig.model_validate(_data(project, task=task, experts={}, batch_size=2))
    capfd.readouterr()
    results = run_lm_eval_compare(config, tmp_path / "quiet", progress=False, echo=None)
    assert 0 <= results["systems"]["base"]["splits"]["tiny_choice/acc"]["value"] <= 1
    quiet = capfd.readouterr()
    assert quiet.err == "" and quiet.out == ""
    run_lm_eval_compare(config, tmp_path / "loud", progress=True, echo=None)  # the check can fail: not silent
    assert capfd.readouterr().err.strip()
    assert json.loads((tmp_path / "quiet" / "results.json").read_text())["tasks"] == ["tiny_choice"]


def test_more_few_shot_examples_than_documents_are_refused_before_the_run_folder(project, tmp_path, capsys):
    """tiny_gen has 2 documents: lm-eval itself fails on 3 shots, with no field, task or number named; the pre-flight
    names them all, and `mergecompose compare` writes nothing into `--out`."""
    task = {"type": "lm_eval", "names": ["tiny_gen"], "include_path": str(project / "tasks")}
    with pytest.raises(ValueError, match="Sample larger than population"):  # lm-eval's own error, unnamed
        lm_eval.simple_evaluate(
            model="hf",
            model_args={"pretrained": str(project / "models" / "base")},
            device="cpu",
            tasks=["tiny_gen"],
            num_fewshot=3,
            task_manager=TaskManager(include_path=str(project / "tasks")),
        )
    check_before_work(LmEvalCompareConfig.model_validate(_data(project, task={**task, "num_fewshot": 2})))
    config = tmp_path / "shots.yaml"
    config.write_text(yaml.safe_dump(_data(project, task={**task, "num_fewshot": 3})))
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["compare", str(config), "--out", str(out)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("mergecompose compare: error: ") and "\n" not in error
    assert "`task.num_fewshot` is 3, but task 'tiny_gen' has 2 documents" in error
    assert error.endswith("(its test split); allowed: at most 2")
    assert not out.exists()
    # Examples drawn from the split being scored leave the scored document out: one fewer is allowed.
    tasks = tmp_path / "tasks"
    write_generate_task(tasks, "own_split", [("AB", "BB"), ("CD", "DD"), ("EF", "FF")], 4)
    text = (tasks / "own_split.yaml").read_text() + "fewshot_split: test\nnum_fewshot: 3\n"
    (tasks / "own_split.yaml").write_text(text)
    own = {"type": "lm_eval", "names": ["own_split"], "include_path": str(tasks)}
    with pytest.raises(
        ValueError,
        match=r"task 'own_split''s `num_fewshot` is 3, .*3 documents .*its `fewshot_split` 'test', less the "
        r"document being scored\); allowed: at most 2",
    ):
        check_before_work(LmEvalCompareConfig.model_validate(_data(project, task=own)))
    check_before_work(LmEvalCompareConfig.model_validate(_data(project, task={**own, "num_fewshot": 2})))


def test_a_task_whose_split_is_missing_is_named_before_the_run_and_in_a_cell(project, tmp_path):
    """`test_split: validation` where the data has only `test`: lm-eval's KeyError: 'validation' names no task. The
    pre-flight names the task; a cell that meets it all the same (a task the pre-flight cannot build: a hub
    dataset) names the system and the task."""
    tasks = tmp_path / "tasks"
    write_generate_task(tasks, "bad_split", [("AB", "BB"), ("CD", "DD")], 4)
    text = (tasks / "bad_split.yaml").read_text().replace("test_split: test", "test_split: validation")
    (tasks / "bad_split.yaml").write_text(text)
    task = {"type": "lm_eval", "names": ["bad_split"], "include_path": str(tasks)}
    with pytest.raises(ValueError, match=r"task 'bad_split' does not load in lm-eval: KeyError: 'validation'"):
        check_before_work(LmEvalCompareConfig.model_validate(_data(project, task=task)))
    store = CellStore(tmp_path / "run", CellSettings(None, None, False, "-"), TaskManager(include_path=str(tasks)))
    model = HFLM(pretrained=str(project / "models" / "base"), device="cpu")
    with pytest.raises(
        ValueError, match=r"lm-eval failed scoring system 'base' on task 'bad_split': KeyError: 'validation'"
    ):
        store.get(System("base", load=lambda: model), TaskRun("bad_split"), lambda: model)
    assert not (tmp_path / "run" / "cells").exists()
