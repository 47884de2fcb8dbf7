"""An output over an input: each command declares the files and folders it reads and writes
(`mergecompose.core.cli_common.declare_paths`), and `mergecompose.cli.main` refuses an output that is, holds
or lies inside an input before anything is written (with `--overwrite` too). Each row's inputs are hashed
before and after, so a row that wrote into them is `data-loss`, not `clear`."""

from __future__ import annotations

import json
import shutil

import yaml

from bad_inputs import Case, Cli

OVER_INPUT = r"is, contains or lies inside the input"


def _copy(env, name: str):
    """A copy of the shared checkpoint `name` in this row's folder (the row may point an output at it)."""
    target = env.tmp / name
    shutil.copytree(env.checkpoints / name, target)
    return target


def _data(env):
    path = env.tmp / "data.jsonl"
    path.write_text('{"text": "abc"}\n')
    return path


def task_vector_out_is_the_expert(env):
    expert = _copy(env, "expert_0")
    return Cli(
        ["task-vector", str(env.checkpoints / "base"), str(expert), "--out", str(expert), "--overwrite"], [expert]
    )


def overlap_out_holds_the_rule(env):
    rules = env.tmp / "R"
    rules.mkdir()
    (rules / "rule.json").write_text(json.dumps({"diagnostic": "projective_error", "threshold": 0.1}))
    argv = ["overlap", "--base", str(env.checkpoints / "base"), "--expert", str(env.checkpoints / "expert_0")]
    argv += ["--data", str(_data(env)), "--recommend", "--rule", str(rules / "rule.json")]
    return Cli([*argv, "--out", str(rules), "--overwrite"], [rules])


def overlap_out_holds_the_config(env):
    folder = env.tmp / "D"
    folder.mkdir()
    config = {
        "base": str(env.checkpoints / "base"),
        "experts": [str(env.checkpoints / "expert_0")],
        "data": str(_data(env)),
        "out": str(env.tmp / "elsewhere"),
    }
    (folder / "overlap.yaml").write_text("# my comments\n" + yaml.safe_dump(config))
    return Cli(["overlap", "--config", str(folder / "overlap.yaml"), "--out", str(folder), "--overwrite"], [folder])


def compare_out_holds_the_config(env):
    folder = env.tmp / "D"
    folder.mkdir()
    shutil.copy("configs/letters.yaml", folder / "config.yaml")
    return Cli(["compare", str(folder / "config.yaml"), "--out", str(folder)], [folder])


def _lm_eval_config(env, expert, task: dict):
    """A `type: lm_eval` compare config in the row's folder, with one expert and its composition."""
    config = {
        "name": "over_an_input",
        "task": {"type": "lm_eval", **task},
        "base": str(env.checkpoints / "base"),
        "experts": {"one": str(expert)},
        "compositions": {"compose": {"experts": ["one"]}},
        "device": "cpu",
        "dtype": "float32",
    }
    path = env.tmp / "lm_eval.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def compare_out_is_an_expert_named_in_the_config(env):
    expert = _copy(env, "expert_1")
    path = _lm_eval_config(env, expert, {"names": ["no_such_task"]})
    return Cli(["compare", str(path), "--out", str(expert)], [expert, path])


def compare_out_is_the_include_path(env):
    tasks = env.tmp / "my_tasks"
    tasks.mkdir()
    (tasks / "mine.yaml").write_text("task: mine\noutput_type: generate_until\n")
    path = _lm_eval_config(env, env.checkpoints / "expert_0", {"names": ["mine"], "include_path": str(tasks)})
    return Cli(["compare", str(path), "--out", str(tasks)], [tasks, path])


def merge_out_inside_an_expert(env):
    expert = _copy(env, "expert_0")
    config = {
        "merge_method": "task_arithmetic",
        "base_model": str(env.checkpoints / "base"),
        "models": [{"model": str(expert), "parameters": {"weight": 1.0}}],
        "dtype": "float32",
    }
    path = env.tmp / "merge.yaml"
    path.write_text(yaml.safe_dump(config))
    return Cli(["merge", str(path), "--out", str(expert / "merged")], [expert, path])


def vllm_model_out_is_the_base(env):
    base = _copy(env, "base")
    return Cli(
        ["vllm-model", "--base", str(base), "--expert", str(env.checkpoints / "expert_0"), "--out", str(base)], [base]
    )


def lm_eval_output_path_is_the_include_path(env):
    tasks = env.tmp / "my_tasks"
    tasks.mkdir()
    (tasks / "mine.yaml").write_text("task: mine\noutput_type: generate_until\n")
    argv = ["lm-eval", "run", "--model", "composed", "--model_args", f"base={env.checkpoints / 'base'}"]
    return Cli([*argv, "--tasks", "mine", "--include_path", str(tasks), "--output_path", str(tasks)], [tasks])


CASES = [
    Case("task-vector-out-is-the-expert", "data-loss", task_vector_out_is_the_expert, r"`--out`.*" + OVER_INPUT),
    Case("overlap-out-holds-the-rule", "data-loss", overlap_out_holds_the_rule, r"`--out`.*" + OVER_INPUT),
    Case("overlap-out-holds-the-config", "data-loss", overlap_out_holds_the_config, r"`--out`.*" + OVER_INPUT),
    Case("compare-out-holds-the-config", "data-loss", compare_out_holds_the_config, r"`--out`.*" + OVER_INPUT),
    Case(
        "compare-out-is-an-expert-of-the-config",
        "data-loss",
        compare_out_is_an_expert_named_in_the_config,
        r"`--out`.*" + OVER_INPUT + r".*expert_1",
    ),
    Case("compare-out-is-the-include-path", "data-loss", compare_out_is_the_include_path, OVER_INPUT + r".*my_tasks"),
    Case("merge-out-inside-an-expert", "clear", merge_out_inside_an_expert, OVER_INPUT),
    Case("vllm-model-out-is-the-base", "clear", vllm_model_out_is_the_base, OVER_INPUT),
    Case("lm-eval-output-path-is-the-include-path", "data-loss", lm_eval_output_path_is_the_include_path, OVER_INPUT),
]
