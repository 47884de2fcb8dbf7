"""Bad numbers and bad vLLM components: weights holding NaN or inf, a weight file cut short, a tensor of
another shape under a matching config.json (`mergecompose vllm-model`), a finite scalar that overflows a
task vector, and a finite but huge `draft_lambda` whose merged draft is not finite."""

from __future__ import annotations

import copy
import shutil

import torch
from safetensors.torch import load_file, save_file

from bad_inputs import Api, Case, Cli
from mergecompose.analysis.data import char_tokenizer
from mergecompose.composition import ComposedLM
from mergecompose.core.tiny import random_llama
from mergecompose.merging import TaskVector

TENSOR = "model.layers.0.mlp.up_proj.weight"
LORA_TENSOR = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _base_with_tokenizer(env):
    """A copy of the shared base with a tokenizer (vLLM needs the base's tokenizer)."""
    folder = env.tmp / "base"
    shutil.copytree(env.checkpoints / "base", folder)
    char_tokenizer("abcdefghijklmnopqrstuvwxyz").save_pretrained(folder)
    return folder


def _copy(source, folder):
    shutil.copytree(source, folder)
    return folder


def _edit_weights(folder, edit, file_name="model.safetensors"):
    state = load_file(str(folder / file_name))
    edit(state)
    save_file(state, str(folder / file_name), metadata={"format": "pt"})
    return folder


def _set(name, value):
    def edit(state):
        state[name].view(-1)[5] = value

    return edit


def _narrower(state):
    state[TENSOR] = state[TENSOR][:-1].contiguous()


def _truncate(folder, file_name="model.safetensors"):
    data = (folder / file_name).read_bytes()
    (folder / file_name).write_bytes(data[: len(data) // 3])
    return folder


def _vllm_model(expert=None, base=None):
    """`mergecompose vllm-model` with the base (or `base(env, folder)`) and one expert `expert(env)`."""

    def build(env):
        base_folder = _base_with_tokenizer(env)
        if base is not None:
            base(base_folder)
        expert_folder = expert(env) if expert is not None else env.checkpoints / "expert_0"
        argv = ["vllm-model", "--base", str(base_folder), "--expert", str(expert_folder), "--out", str(env.tmp / "o")]
        return Cli(argv, inputs=[base_folder, expert_folder])

    return build


def _full(edit):
    return lambda env: edit(_copy(env.checkpoints / "expert_0", env.tmp / "expert"))


def _lora(edit):
    return lambda env: edit(_copy(env.lora_dirs["ab"], env.tmp / "adapter"))


def _task_vector_times(scalar, left=False):
    def build(env):
        tau = TaskVector.from_checkpoints(env.checkpoints / "base", env.checkpoints / "expert_0")
        return Api(lambda: scalar * tau if left else tau * scalar)

    return build


def _speculate_with_lambda(lambdas, adapters=False):
    """`generate(draft='merged', draft_lambda=lambdas)` of the base composed with a full expert (or an adapter)."""

    def build(env):
        if adapters:
            # from_adapters injects the adapters into the base it is given: a copy, not the session's shared model
            composed = ComposedLM.from_adapters(copy.deepcopy(env.base_model), {"ab": str(env.lora_dirs["ab"])})
        else:
            composed = ComposedLM(env.base_model, [random_llama(env.tiny_config, seed=1)])
        options = {"max_new_tokens": 2, "eos_token_id": [], "draft": "merged", "draft_lambda": lambdas}
        return Api(lambda: composed.generate(torch.arange(4, 7)[None], **options))

    return build


NONFINITE = r"has non-finite weights: tensor `{tensor}` \(\d+, \d+\) holds {nan} NaN and {inf} inf values"
DRAFT = r"the merged draft \(draft='merged'\) has non-finite weights: tensor `.*` .*`draft_lambda` \[1e\+300\]"

CASES = [
    Case(
        "vllm-model-nan-in-a-full-expert",
        "silent",
        _vllm_model(_full(lambda folder: _edit_weights(folder, _set(TENSOR, float("nan"))))),
        r"`experts\[0\]` '.*expert' " + NONFINITE.format(tensor=TENSOR, nan=1, inf=0),
    ),
    Case(
        "vllm-model-inf-in-the-base",
        "silent",
        _vllm_model(base=lambda folder: _edit_weights(folder, _set(TENSOR, float("inf")))),
        r"`base` '.*base' " + NONFINITE.format(tensor=TENSOR, nan=0, inf=1),
    ),
    Case(
        "vllm-model-nan-in-a-lora-adapter",
        "silent",
        _vllm_model(_lora(lambda f: _edit_weights(f, _set(LORA_TENSOR, float("nan")), "adapter_model.safetensors"))),
        r"`experts\[0\]` '.*adapter' " + NONFINITE.format(tensor=LORA_TENSOR, nan=1, inf=0),
    ),
    Case(
        "vllm-model-truncated-expert-weights",
        "silent",
        _vllm_model(_full(_truncate)),
        r"`experts\[0\]` '.*expert/model\.safetensors': has \d+ bytes, its header describes \d+ \(truncated",
    ),
    Case(
        "vllm-model-truncated-base-weights",
        "silent",
        _vllm_model(base=_truncate),
        r"`base` '.*base/model\.safetensors': has \d+ bytes, its header describes \d+ \(truncated",
    ),
    Case(
        "vllm-model-truncated-adapter-weights",
        "silent",
        _vllm_model(_lora(lambda folder: _truncate(folder, "adapter_model.safetensors"))),
        r"`experts\[0\]` '.*adapter/adapter_model\.safetensors': .*truncated",
    ),
    Case(
        "vllm-model-tensor-of-another-shape",
        "silent",
        _vllm_model(_full(lambda folder: _edit_weights(folder, _narrower))),
        rf"`experts\[0\]` '.*expert': tensor `{TENSOR}` has shape \(63, 32\), the base's \(64, 32\)",
    ),
    Case(
        "task-vector-times-1e300",
        "silent",
        _task_vector_times(1e300),
        r"the scalar a task vector is multiplied by must keep it finite, got 1e\+300: tensor `.*` .* overflows",
    ),
    Case(
        "1e300-times-task-vector",
        "silent",
        _task_vector_times(-1e300, left=True),
        r"must keep it finite, got -1e\+300: tensor `.*` .* overflows torch\.float32",
    ),
    Case(
        "task-vector-times-nan",
        "silent",
        _task_vector_times(float("nan")),
        r"the scalar a task vector is multiplied by must be a finite real number, got nan",
    ),
    Case(
        "inf-times-task-vector",
        "silent",
        _task_vector_times(float("inf"), left=True),
        r"must be a finite real number, got inf",
    ),
    Case("generate-draft-lambda-1e300", "silent", _speculate_with_lambda([1e300]), DRAFT),
    Case("generate-lora-draft-lambda-1e300", "silent", _speculate_with_lambda([1e300], adapters=True), DRAFT),
]
