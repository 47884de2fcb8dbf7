"""Bad input to the lm-eval surfaces: the `composed` model's model_args through `mergecompose lm-eval`, and what a
`type: lm_eval` compare needs of its tasks, metrics, generation settings, device and experts (its pre-flight)."""

from __future__ import annotations

import shutil

import torch
import yaml
from lm_eval.api.registry import get_model

import mergecompose.integrations.lm_eval.harness_model  # noqa: F401  (registers `composed`)
from bad_inputs import Api, Case, Cli
from mergecompose.core.tiny import random_llama, tiny_llama_config
from mergecompose.experiments.lm_eval.native_run import write_generate_task


def unknown_model_arg(env):
    """Through `mergecompose lm-eval` (lm-eval's own CLI builds its full task index first: one row only)."""
    write_generate_task(env.tmp / "tasks", "tiny_gen", [("AB", "BB")], 4)
    model_args = f"base={env.checkpoints / 'base'},experts={env.checkpoints / 'expert_0'},nosuch_arg=1"
    return Cli(
        ["lm-eval", "--model", "composed", "--model_args", model_args, "--tasks", "tiny_gen", "--device", "cpu"]
        + ["--include_path", str(env.tmp / "tasks")]
    )


def _from_arg_string(model_args: str) -> Api:
    """As lm-eval's CLI creates the model: its own batch_size and device beside the model_args."""
    return Api(lambda: get_model("composed").create_from_arg_string(model_args, {"batch_size": 1, "device": "cpu"}))


def misspelt_model_arg(env):
    return _from_arg_string(f"base={env.checkpoints / 'base'},experts={env.checkpoints / 'expert_0'},weigths=1")


def missing_base(env):
    return _from_arg_string(f"experts={env.checkpoints / 'expert_0'}")


def _compare(env, tasks=None, **changes) -> Cli:
    """`mergecompose compare` on a config beside a folder of one tiny task (`tasks` written there, if given)."""
    folder = env.tmp / "tasks"
    write_generate_task(folder, "tiny_gen", [("AB", "BB")], 4)
    for name, text in (tasks or {}).items():
        (folder / name).write_text(text)
    config = {
        "task": {"type": "lm_eval", "names": ["tiny_gen"], "include_path": "tasks"},  # beside the config
        "base": str(env.checkpoints / "base"),
        "experts": {"one": str(env.checkpoints / "expert_0"), "two": str(env.checkpoints / "expert_1")},
        **changes,
    }
    path = env.tmp / "compare.yaml"
    path.write_text(yaml.safe_dump(config))
    return Cli(["compare", str(path), "--out", str(env.tmp / "out")], inputs=[path, folder])


def task_yaml_bad_output_type(env):
    return _compare(env, {"broken.yaml": "task: broken\ndataset_path: json\noutput_type: generation\n"})


def task_yaml_unparseable(env):
    return _compare(env, {"broken.yaml": "task: broken\noutput_type: [generate_until\n"})


def selection_metric_unknown(env):
    return _compare(
        env,
        merges={"task_arithmetic": {"lam": [0.5, 1.0]}},
        merge_selection={"task": "tiny_gen", "metric": "acc"},
    )


def gen_kwargs_unsupported(env):
    task = {"type": "lm_eval", "names": ["tiny_gen"], "include_path": "tasks", "gen_kwargs": {"num_beams": 4}}
    return _compare(env, task=task, compositions={"compose": {"experts": ["one", "two"]}})


def device_cuda_without_cuda(env):
    return _compare(env, device="cuda")


def expert_of_another_vocabulary(env):
    random_llama(tiny_llama_config(vocab_size=80), seed=5).save_pretrained(env.tmp / "big_vocabulary")
    experts = {"one": str(env.checkpoints / "expert_0"), "big": str(env.tmp / "big_vocabulary")}
    return _compare(env, experts=experts, compositions={"compose": {"experts": ["one", "big"]}})


def expert_truncated(env):
    copy = env.tmp / "truncated_expert"
    shutil.copytree(env.checkpoints / "expert_0", copy)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return _compare(env, experts={"one": str(copy)})


CASES = [
    Case("lm-eval-model-arg-unknown", "silent", unknown_model_arg, r"no model_arg \['nosuch_arg'\].*valid model_args"),
    Case("lm-eval-model-arg-misspelt", "silent", misspelt_model_arg, r"did you mean 'weights' for 'weigths'"),
    Case("lm-eval-model-arg-base-missing", "traceback", missing_base, r"model_args `base` .*missing"),
    Case("lm-eval-task-yaml-output-type", "misleading", task_yaml_bad_output_type, r"broken\.yaml.*`output_type`"),
    Case("lm-eval-task-yaml-unparseable", "misleading", task_yaml_unparseable, r"broken\.yaml.*cannot be read as YAML"),
    Case("lm-eval-selection-metric", "clear", selection_metric_unknown, r"`merge_selection.metric` 'acc' is not a"),
    Case("lm-eval-gen-kwargs", "clear", gen_kwargs_unsupported, r"`task.gen_kwargs` \['num_beams'\] are not supported"),
    Case(
        "lm-eval-device-cuda",
        "traceback",
        device_cuda_without_cuda,
        r"`device` is 'cuda' but this machine has no CUDA device",
        skip="this machine has CUDA" if torch.cuda.is_available() else None,
    ),
    Case(
        "lm-eval-expert-vocabulary",
        "misleading",
        expert_of_another_vocabulary,
        r"expert 'big' \('.*big_vocabulary', used in composition 'compose'\) has a vocabulary of 80 ids",
    ),
    Case("lm-eval-expert-truncated", "traceback", expert_truncated, r"experts\.one.*model\.safetensors"),
]
