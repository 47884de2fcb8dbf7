"""Bad files from the user's disk, refused by the loading boundary (`mergecompose.core.boundary`) before anything
loads: a truncated expert through each entry point, a relative path taken for a hub id with the hub unreachable,
a misspelt mergekit key, a sharded checkpoint missing a shard, an unreadable config.json, a folder named
model.safetensors, an empty adapter file, a GGUF file that is not one."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import struct

import yaml
from huggingface_hub import constants
from safetensors.torch import load_file, save_file

from bad_inputs import Api, Case, Cli
from mergecompose.composition import ComposedLM
from mergecompose.merging import TaskVector

_TRUNCATED = r"model\.safetensors': has \d+ bytes, its header describes \d+ \(truncated or changed\)"


def _copy(env, name: str) -> str:
    """A copy of the shared checkpoint or adapter `name` (expert_0, base or a LoRA name) in the row's folder."""
    source = env.lora_dirs[name] if name in env.lora_dirs else env.checkpoints / name
    return str(shutil.copytree(source, env.tmp / f"copy_{name}"))


def _truncated_expert(env) -> str:
    folder = _copy(env, "expert_0")
    weights = os.path.join(folder, "model.safetensors")
    os.truncate(weights, os.path.getsize(weights) - 512)
    return folder


def _merge_cli(env, config: dict) -> Cli:
    path = env.tmp / "merge.yaml"
    path.write_text(yaml.safe_dump(config))
    return Cli(["merge", str(path), "--out", str(env.tmp / "out")], inputs=[path])


def _mergekit_config(env, expert: str, base: str | None = None) -> dict:
    return {
        "merge_method": "task_arithmetic",
        "base_model": base or str(env.checkpoints / "base"),
        "models": [{"model": expert, "parameters": {"weight": 1.0}}],
        "dtype": "float32",
    }


# ---- a truncated expert, through each entry point ---------------------------------------------


def merge_truncated_expert(env):
    expert = _truncated_expert(env)
    spec = _merge_cli(env, _mergekit_config(env, expert))
    spec.inputs = [*spec.inputs, env.tmp / "copy_expert_0"]
    return spec


def composed_truncated_expert(env):
    expert = _truncated_expert(env)
    return Api(lambda: ComposedLM.from_pretrained(str(env.checkpoints / "base"), experts=[expert]), inputs=[expert])


def task_vector_truncated_expert(env):
    expert = _truncated_expert(env)
    return Api(lambda: TaskVector.from_checkpoints(env.checkpoints / "base", expert), inputs=[expert])


# ---- a relative path of the form owner/name, the hub unreachable -------------------------------


@contextlib.contextmanager
def _unreachable_hub():
    """Online, with `HF_ENDPOINT` at a local port nobody listens on; everything put back afterwards."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()
    names = ("HF_ENDPOINT", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved_environment = {name: os.environ.pop(name, None) for name in names}
    saved_constants = constants.ENDPOINT, constants.HF_HUB_OFFLINE
    os.environ["HF_ENDPOINT"] = endpoint
    constants.ENDPOINT, constants.HF_HUB_OFFLINE = endpoint, False
    try:
        yield
    finally:
        constants.ENDPOINT, constants.HF_HUB_OFFLINE = saved_constants
        for name, value in saved_environment.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def composed_base_missing_dir(env):
    def call():
        previous = os.getcwd()
        os.chdir(env.tmp)  # `missing_dir/` does not exist here, so the value has the form of a hub id
        try:
            with _unreachable_hub():
                return ComposedLM.from_pretrained("missing_dir/base", experts=[str(env.checkpoints / "expert_0")])
        finally:
            os.chdir(previous)

    return Api(call)


# ---- the other bad files -----------------------------------------------------------------------


def merge_mergekit_key_misspelt(env):
    config = _mergekit_config(env, str(env.checkpoints / "expert_0"))
    config["modelz"] = config.pop("models")
    return _merge_cli(env, config)


def merge_sharded_base_missing_shard(env):
    base = _copy(env, "base")
    tensors = load_file(os.path.join(base, "model.safetensors"))
    os.remove(os.path.join(base, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    save_file({name: tensors[name] for name in names[::2]}, os.path.join(base, "model-00001-of-00002.safetensors"))
    weight_map = {name: shard for shard, keys in shards.items() for name in keys}
    with open(os.path.join(base, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {}, "weight_map": weight_map}, handle)
    spec = _merge_cli(env, _mergekit_config(env, str(env.checkpoints / "expert_0"), base=base))
    spec.inputs = [*spec.inputs, env.tmp / "copy_base"]
    return spec


def composed_expert_config_unreadable(env):
    expert = _copy(env, "expert_0")
    os.chmod(os.path.join(expert, "config.json"), 0)
    return Api(lambda: ComposedLM.from_pretrained(str(env.checkpoints / "base"), experts=[expert]), inputs=[expert])


def task_vector_weights_are_a_folder(env):
    expert = _copy(env, "expert_0")
    os.remove(os.path.join(expert, "model.safetensors"))
    os.mkdir(os.path.join(expert, "model.safetensors"))
    return Cli(["task-vector", str(env.checkpoints / "base"), expert])


def composed_adapter_weights_empty(env):
    adapter = _copy(env, "ab")
    open(os.path.join(adapter, "adapter_model.safetensors"), "w").close()
    return Api(lambda: ComposedLM.from_pretrained(str(env.checkpoints / "base"), experts=[adapter]), inputs=[adapter])


def convert_gguf_wrong_magic(env):
    path = env.tmp / "model.gguf"
    path.write_bytes(struct.pack("<4sIQQ", b"GGML", 3, 0, 0))
    return Cli(["convert-gguf", str(path), "--out", str(env.tmp / "out")], inputs=[path])


_ROOT = "root reads a file whatever its mode" if os.geteuid() == 0 else None

CASES = [
    Case(
        "boundary-merge-truncated-expert", "traceback", merge_truncated_expert, rf"`models\[0\]\.model` .*{_TRUNCATED}"
    ),
    Case(
        "boundary-composed-truncated-expert", "traceback", composed_truncated_expert, rf"`experts\[0\]` .*{_TRUNCATED}"
    ),
    Case(
        "boundary-task-vector-truncated-expert",
        "traceback",
        task_vector_truncated_expert,
        rf"`finetuned` .*{_TRUNCATED}",
    ),
    Case(
        "boundary-composed-base-missing-dir-hub-unreachable",
        "misleading",
        composed_base_missing_dir,
        r"^`base` 'missing_dir/base': no such local folder, and not reachable as a hub id \(.*connection refused\)",
    ),
    Case(
        "boundary-merge-mergekit-key-misspelt",
        "misleading",
        merge_mergekit_key_misspelt,
        r"top-level key `modelz` is not one mergekit reads; did you mean `models`\?",
    ),
    Case(
        "boundary-merge-sharded-base-missing-shard",
        "traceback",
        merge_sharded_base_missing_shard,
        r"model-00002-of-00002\.safetensors': is missing: model\.safetensors\.index\.json maps \d+ tensors to it",
    ),
    Case(
        "boundary-composed-expert-config-unreadable",
        "traceback",
        composed_expert_config_unreadable,
        r"`experts\[0\]` .*config\.json': cannot be read \(permission denied\)",
        skip=_ROOT,
    ),
    Case(
        "boundary-task-vector-weights-are-a-folder",
        "traceback",
        task_vector_weights_are_a_folder,
        r"model\.safetensors': is a folder, not a file",
    ),
    Case(
        "boundary-composed-adapter-weights-empty",
        "traceback",
        composed_adapter_weights_empty,
        r"`experts\[0\]` .*adapter_model\.safetensors': is empty",
    ),
    Case(
        "boundary-convert-gguf-wrong-magic",
        "traceback",
        convert_gguf_wrong_magic,
        r"is not a GGUF file: it starts with b'GGML'",
    ),
]
