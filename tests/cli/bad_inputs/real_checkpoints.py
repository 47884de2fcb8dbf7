"""Bad input that real checkpoints bring: vocabulary rows beyond the base's that are real tokens (or cannot be told
from padding), adapters that save embeddings resized for another vocabulary, and adapters that record another
base than the one given, with the same shapes."""

from __future__ import annotations

import copy
import json

from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from bad_inputs import Api, Case, Cli
from mergecompose.analysis.data import char_tokenizer
from mergecompose.composition import ComposedLM
from mergecompose.core.tiny import random_llama, random_lora_adapter
from mergecompose.merging import TaskVector

CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ01234567"  # + 4 special tokens = 64 ids


def _padded_expert(env, rows=128) -> str:
    """The shared base with its embeddings resized to `rows` (it has 64): an expert with padded rows."""
    model = copy.deepcopy(env.base_model)
    model.resize_token_embeddings(rows, mean_resizing=False)
    model.save_pretrained(env.tmp / "padded")
    return str(env.tmp / "padded")


def _base_with_tokenizer(env, characters: str) -> str:
    """The shared base's files beside a tokenizer of `characters` + 4 special tokens."""
    base = env.tmp / "base_with_tokenizer"
    base.mkdir()
    for name in ["config.json", "model.safetensors"]:
        (base / name).symlink_to(env.checkpoints / "base" / name)
    char_tokenizer(characters).save_pretrained(base)
    return str(base)


def composed_padded_rows_are_tokens(env):
    base = _base_with_tokenizer(env, CHARACTERS + "89+-*/")  # 70 ids: 6 beyond the base's 64 rows
    expert = _padded_expert(env)
    return Api(lambda: ComposedLM.from_pretrained(base, [expert]), inputs=[env.tmp])


def composed_padded_rows_without_tokenizer(env):
    expert = _padded_expert(env)
    return Api(lambda: ComposedLM.from_pretrained(str(env.checkpoints / "base"), [expert]), inputs=[env.tmp])


def overlap_cli_padded_rows_without_tokenizer(env):
    data = env.tmp / "data.jsonl"
    data.write_text('{"text": "abc"}\n')
    expert = _padded_expert(env)
    argv = ["overlap", "--base", str(env.checkpoints / "base"), "--expert", expert, "--data", str(data)]
    return Cli([*argv, "--out", str(env.tmp / "out")], inputs=[data, env.tmp / "padded"])


def _adapter_with_resized_embeddings(env) -> str:
    """An adapter trained on the base with its embeddings resized to 128 rows, saving them whole."""
    config = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"])
    get_peft_model(AutoModelForCausalLM.from_pretrained(_padded_expert(env)), config).save_pretrained(
        env.tmp / "resized"
    )
    return str(env.tmp / "resized")


def composed_adapter_with_resized_embeddings(env):
    adapter = _adapter_with_resized_embeddings(env)
    return Api(lambda: ComposedLM.from_pretrained(str(env.checkpoints / "base"), [adapter]), inputs=[env.tmp])


def task_vector_lora_with_resized_embeddings(env):
    adapter = _adapter_with_resized_embeddings(env)
    call = lambda: TaskVector.from_lora(AutoModelForCausalLM.from_pretrained(env.checkpoints / "base"), adapter)  # noqa: E731
    return Api(call, inputs=[env.tmp])


def _adapter_on_another_base(env) -> str:
    """An adapter trained on `other_base/` (same shapes as the shared base, other weights), which it records."""
    random_llama(env.tiny_config, seed=9).save_pretrained(env.tmp / "other_base")
    other = AutoModelForCausalLM.from_pretrained(env.tmp / "other_base")
    return str(random_lora_adapter(other, env.tmp / "on_other_base", seed=3))


def composed_adapter_records_another_base(env):
    adapter = _adapter_on_another_base(env)
    call = lambda: ComposedLM.from_pretrained(str(env.checkpoints / "base"), [adapter]).close()  # noqa: E731
    return Api(call, inputs=[env.tmp], warns=UserWarning)


def composed_adapter_records_another_hub_model(env):
    """A base fetched by `mergecompose fetch-model` (its conversion.json) and an adapter recording another hub id."""
    base = env.tmp / "fetched"
    base.mkdir()
    for name in ["config.json", "model.safetensors"]:
        (base / name).symlink_to(env.checkpoints / "base" / name)
    (base / "conversion.json").write_text(json.dumps({"model": "smollm2-135m-instruct"}))
    adapter = env.tmp / "adapter"
    random_lora_adapter(env.base_model, adapter, seed=4)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "HuggingFaceTB/SmolLM2-360M-Instruct"
    (adapter / "adapter_config.json").write_text(json.dumps(config))

    def call():
        ComposedLM.from_adapters(AutoModelForCausalLM.from_pretrained(base), {"math": str(adapter)}).close()

    return Api(call, inputs=[env.tmp], warns=UserWarning)


def task_vector_lora_records_another_base(env):
    adapter = _adapter_on_another_base(env)
    call = lambda: TaskVector.from_lora(AutoModelForCausalLM.from_pretrained(env.checkpoints / "base"), adapter)  # noqa: E731
    return Api(call, inputs=[env.tmp], warns=UserWarning)


CASES = [
    Case(
        "composed-api-padded-rows-are-tokens",
        "misleading",
        composed_padded_rows_are_tokens,
        r"`experts\[0\]` '.*padded' has 128 output tokens, `base` '.*' has 64, and the tokenizer has ids up to 69",
    ),
    Case(
        "composed-api-padded-rows-without-tokenizer",
        "misleading",
        composed_padded_rows_without_tokenizer,
        r"`experts\[0\]` '.*padded' has 128 output tokens, `base` '.*base' has 64; without a tokenizer",
    ),
    Case(
        "overlap-cli-padded-rows-without-tokenizer",
        "misleading",
        overlap_cli_padded_rows_without_tokenizer,
        r"`experts\[0\]` '.*padded' has 128 output tokens, `base` '.*base' has 64; without a tokenizer",
    ),
    Case(
        "composed-api-adapter-with-resized-embeddings",
        "traceback",
        composed_adapter_with_resized_embeddings,
        r"adapter `experts\[0\]` saves `.*` whole with shape \(128, 32\), but the base's .* \(64, 32\): a vocabulary",
    ),
    Case(
        "task-vector-lora-with-resized-embeddings",
        "traceback",
        task_vector_lora_with_resized_embeddings,
        r"saves `.*` whole with shape \(128, 32\), but the base's .* \(64, 32\): a vocabulary of 128 rows",
    ),
    Case(
        "composed-api-adapter-records-another-base",
        "silent",
        composed_adapter_records_another_base,
        r"`experts\[0\]` records its base as '.*other_base'.*, but the base given is '.*base'",
    ),
    Case(
        "composed-api-adapter-records-another-hub-model",
        "silent",
        composed_adapter_records_another_hub_model,
        r"`adapters\['math'\]` records its base as 'HuggingFaceTB/SmolLM2-360M-Instruct'.* given is '.*fetched'",
    ),
    Case(
        "task-vector-lora-records-another-base",
        "silent",
        task_vector_lora_records_another_base,
        r"`adapter` records its base as '.*other_base'.*, but the base given is '.*base'",
    ),
]
