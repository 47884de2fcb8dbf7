"""Bad input to loading models, tokenizers and adapters: missing local folders taken for hub ids, folders
that are not what they are passed as, adapters made for another base, hub ids in offline mode."""

from __future__ import annotations

import contextlib
import os

import yaml

from bad_inputs import Api, Case, Cli
from mergecompose.composition import ComposedLM
from mergecompose.core.tiny import random_llama, random_lora_adapter, tiny_llama_config
from mergecompose.merging import TaskVector, merge_checkpoints

NOT_CACHED = "mergecompose-tests/not-a-cached-model"


@contextlib.contextmanager
def _environment(**variables):
    """Set environment variables for one call and put back what was there."""
    previous = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _offline(call):
    def run():
        with _environment(HF_HUB_OFFLINE="1"):
            return call()

    return run


def _in_folder(folder, call):
    """`call()` with `folder` as the working directory (relative paths are read from there)."""

    def run():
        previous = os.getcwd()
        os.chdir(folder)
        try:
            return call()
        finally:
            os.chdir(previous)

    return run


def _data(env) -> str:
    path = env.tmp / "data.jsonl"
    path.write_text('{"text": "abc"}\n')
    return str(path)


def _expert(env) -> str:
    return str(env.checkpoints / "expert_0")


def _adapter_for_another_base(env) -> str:
    other = random_llama(tiny_llama_config(hidden_size=48, num_heads=2), seed=4)
    return str(random_lora_adapter(other, env.tmp / "adapter_h48", seed=5))


def _merge_cli(env, **overrides) -> Cli:
    config = {
        "merge_method": "task_arithmetic",
        "base_model": str(env.checkpoints / "base"),
        "models": [{"model": _expert(env), "parameters": {"weight": 1.0}}],
        "dtype": "float32",
    }
    config.update(overrides)
    path = env.tmp / "merge.yaml"
    path.write_text(yaml.safe_dump(config))
    return Cli(["merge", str(path), "--out", str(env.tmp / "out")])


# ---- a missing local folder is reported at once, not taken for a hub id --------------------------


def overlap_cli_base_missing(env):
    return Cli(
        [
            "overlap",
            "--base",
            "./missing_base",
            "--expert",
            _expert(env),
            "--data",
            _data(env),
            "--out",
            str(env.tmp / "out"),
        ]
    )


def overlap_cli_tokenizer_missing(env):
    return Cli(
        [
            "overlap",
            "--base",
            str(env.checkpoints / "base"),
            "--expert",
            _expert(env),
            "--data",
            _data(env),
            "--tokenizer",
            "./missing_tokenizer",
            "--out",
            str(env.tmp / "out"),
        ]
    )


def composed_api_expert_missing_under_existing_folder(env):
    (env.tmp / "models").mkdir()  # `models/missing` is local: its parent folder exists
    call = _in_folder(
        env.tmp, lambda: ComposedLM.from_pretrained(str(env.checkpoints / "base"), experts=["models/missing"])
    )
    return Api(call)


def task_vector_cli_finetuned_missing(env):
    return Cli(["task-vector", str(env.checkpoints / "base"), "./no_such_expert"])


def task_vector_cli_base_is_a_file(env):
    (env.tmp / "base.txt").write_text("not a model")
    return Cli(["task-vector", str(env.tmp / "base.txt"), _expert(env)])


def merge_cli_base_missing_relative(env):
    return _merge_cli(env, base_model="./models/missing_base")


def merge_cli_model_not_a_hub_id(env):
    return _merge_cli(env, models=[{"model": "no such model!", "parameters": {"weight": 1.0}}])


# ---- folders that are not what they are passed as ------------------------------------------------


def composed_api_empty_base(env):
    (env.tmp / "empty").mkdir()
    return Api(lambda: ComposedLM.from_pretrained(str(env.tmp / "empty"), experts=[_expert(env)]))


def composed_api_adapter_as_base(env):
    return Api(lambda: ComposedLM.from_pretrained(str(env.lora_dirs["ab"]), experts=[_expert(env)]))


def composed_api_expert_is_neither(env):
    (env.tmp / "notes").mkdir()
    (env.tmp / "notes" / "README.md").write_text("my notes")
    return Api(lambda: ComposedLM.from_pretrained(str(env.checkpoints / "base"), experts=[str(env.tmp / "notes")]))


def composed_api_adapter_for_another_base(env):
    adapter = _adapter_for_another_base(env)
    return Api(lambda: ComposedLM.from_pretrained(str(env.checkpoints / "base"), experts=[_expert(env), adapter]))


def overlap_cli_base_without_config(env):
    (env.tmp / "weights_only").mkdir()
    (env.tmp / "weights_only" / "model.safetensors").write_bytes(b"")
    return Cli(
        [
            "overlap",
            "--base",
            str(env.tmp / "weights_only"),
            "--expert",
            _expert(env),
            "--data",
            _data(env),
            "--out",
            str(env.tmp / "out"),
        ]
    )


# ---- hub ids with HF_HUB_OFFLINE=1: refused at once, no retries ----------------------------------


def composed_api_offline_hub_base(env):
    return Api(_offline(lambda: ComposedLM.from_pretrained(NOT_CACHED, experts=[_expert(env)])))


def task_vector_api_offline_hub_adapter(env):
    return Api(_offline(lambda: TaskVector.from_lora(env.base_model, NOT_CACHED)))


def merge_api_offline_hub_model(env):
    config = {
        "merge_method": "task_arithmetic",
        "base_model": str(env.checkpoints / "base"),
        "models": [{"model": NOT_CACHED, "parameters": {"weight": 1.0}}],
    }
    return Api(_offline(lambda: merge_checkpoints(config, env.tmp / "out")))


OFFLINE = r"not a local folder, so it is a hub id, and HF_HUB_OFFLINE is set but the hub cache does not hold it"

CASES = [
    Case(
        "overlap-cli-base-missing", "misleading", overlap_cli_base_missing, r"`base` '\./missing_base': no such folder"
    ),
    Case(
        "overlap-cli-tokenizer-missing",
        "misleading",
        overlap_cli_tokenizer_missing,
        r"`tokenizer` '\./missing_tokenizer': no such folder",
    ),
    Case(
        "composed-api-expert-missing-under-existing-folder",
        "misleading",
        composed_api_expert_missing_under_existing_folder,
        r"`experts\[0\]` 'models/missing': no such folder",
    ),
    Case(
        "task-vector-cli-finetuned-missing",
        "misleading",
        task_vector_cli_finetuned_missing,
        r"`finetuned\[0\]` '\./no_such_expert': no such folder",
    ),
    Case(
        "task-vector-cli-base-is-a-file",
        "traceback",
        task_vector_cli_base_is_a_file,
        r"`base` '.*base\.txt' is a file, not a folder",
    ),
    Case(
        "merge-cli-base-missing-relative",
        "misleading",
        merge_cli_base_missing_relative,
        r"`base_model` '\./models/missing_base': no such folder",
    ),
    Case(
        "merge-cli-model-not-a-hub-id",
        "misleading",
        merge_cli_model_not_a_hub_id,
        r"`models\[0\]\.model` 'no such model!': no such folder, and not a hub id",
    ),
    Case(
        "composed-api-empty-base",
        "misleading",
        composed_api_empty_base,
        r"`base` '.*empty' is not a model folder: it has no config\.json \(the folder is empty\)",
    ),
    Case(
        "composed-api-adapter-as-base",
        "misleading",
        composed_api_adapter_as_base,
        r"`base` '.*' is a peft adapter folder, not a full checkpoint",
    ),
    Case(
        "composed-api-expert-is-neither",
        "misleading",
        composed_api_expert_is_neither,
        r"`experts\[0\]` '.*notes' is neither a model folder nor a peft adapter folder.*README\.md",
    ),
    Case(
        "composed-api-adapter-for-another-base",
        "traceback",
        composed_api_adapter_for_another_base,
        r"adapter `.*adapter_h48` was made for another base: its `.*lora_A\.weight` has shape \(4, \d+\), "
        r"but the base's `.*\.weight` has shape \(32, \d+\)",
    ),
    Case(
        "overlap-cli-base-without-config",
        "misleading",
        overlap_cli_base_without_config,
        r"`base` '.*weights_only' is not a model folder: it has no config\.json \(it holds model\.safetensors\)",
    ),
    Case(
        "composed-api-offline-hub-base",
        "misleading",
        composed_api_offline_hub_base,
        r"`base` 'mergecompose-tests/not-a-cached-model' is " + OFFLINE,
    ),
    Case(
        "task-vector-api-offline-hub-adapter",
        "misleading",
        task_vector_api_offline_hub_adapter,
        r"`adapter` '.*not-a-cached-model' is " + OFFLINE,
    ),
    Case(
        "merge-api-offline-hub-model",
        "misleading",
        merge_api_offline_hub_model,
        r"`models\[0\]\.model` '.*not-a-cached-model' is " + OFFLINE,
    ),
]
