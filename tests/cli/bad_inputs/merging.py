"""Bad input to merging: non-finite or integer weights, mergekit YAML and merge grids out of range,
checkpoints that do not fit together, adapters where full checkpoints belong."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from bad_inputs import Api, Case, Cli
from mergecompose.core.tiny import random_llama, random_lora_adapter, tiny_llama_config
from mergecompose.merging import TaskVector, combine_lora_adapters, merge, merge_checkpoints

BROKEN = "model.layers.0.mlp.up_proj.weight"


def _write(env, name: str, data) -> str:
    path = env.tmp / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(path)


def _mergekit(env, *experts, **overrides) -> dict:
    experts = experts or (env.checkpoints / "expert_0", env.checkpoints / "expert_1")
    config = {
        "merge_method": "task_arithmetic",
        "base_model": str(env.checkpoints / "base"),
        "models": [{"model": str(path), "parameters": {"weight": 0.5}} for path in experts],
        "parameters": {"lambda": 1.0},
        "dtype": "float32",
    }
    config.update(overrides)
    return config


def _merge_cli(env, config: dict, *flags) -> Cli:
    return Cli(["merge", _write(env, "merge.yaml", config), "--out", str(env.tmp / "out"), *flags])


def _broken_checkpoint(env, name: str, change) -> str:
    """A copy of expert_0 whose tensors go through `change(state)` (in place)."""
    folder = env.tmp / name
    shutil.copytree(env.checkpoints / "expert_0", folder)
    state = load_file(str(folder / "model.safetensors"))
    change(state)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


def _nan_expert(env) -> str:
    return _broken_checkpoint(env, "nan_expert", lambda state: state[BROKEN].view(-1).__setitem__(3, float("nan")))


def _inf_expert(env) -> str:
    return _broken_checkpoint(env, "inf_expert", lambda state: state[BROKEN].view(-1).__setitem__(5, float("inf")))


def _int64_expert(env) -> str:
    def to_int(state):
        for name in state:
            state[name] = (state[name] * 100).long()

    return _broken_checkpoint(env, "int64_expert", to_int)


def _nan_adapter(env, source="ab") -> str:
    folder = env.tmp / "nan_adapter"
    shutil.copytree(env.lora_dirs[source], folder)
    state = load_file(str(folder / "adapter_model.safetensors"))
    name = sorted(state)[0]
    state[name].view(-1)[0] = float("nan")
    save_file(state, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    return str(folder)


def _other_shape(env, hidden_size=16, vocab_size=64) -> str:
    folder = env.tmp / f"other_h{hidden_size}_v{vocab_size}"
    random_llama(
        tiny_llama_config(hidden_size=hidden_size, num_heads=2, vocab_size=vocab_size), seed=3
    ).save_pretrained(folder)
    return str(folder)


def _expert_state(env, change) -> dict:
    state = {name: tensor.clone() for name, tensor in env.base_model.state_dict().items()}
    change(state)
    return state


# ---- non-finite and integer weights ------------------------------------------------------------


def merge_cli_nan_expert(env):
    return _merge_cli(env, _mergekit(env, _nan_expert(env), env.checkpoints / "expert_1"))


def merge_cli_inf_expert_our_config(env):
    config = {"method": "ties", "base": str(env.checkpoints / "base"), "experts": [_inf_expert(env)], "density": 0.5}
    return _merge_cli(env, config)


def merge_cli_result_overflows(env):
    config = _mergekit(env, parameters={"lambda": 1e30})
    config["models"][0]["parameters"]["weight"] = 1e30
    return _merge_cli(env, config, "--quiet")  # mergekit's progress bars ran before the check


def merge_cli_int64_expert(env):
    return _merge_cli(env, _mergekit(env, _int64_expert(env)))


def merge_api_nan_expert(env):
    state = _expert_state(env, lambda state: state[BROKEN].view(-1).__setitem__(0, float("nan")))
    return Api(lambda: merge("task_arithmetic", env.base_model, [state], progress=False))


def merge_api_inf_base(env):
    base = _expert_state(env, lambda state: state[BROKEN].view(-1).__setitem__(0, float("-inf")))
    return Api(lambda: merge("ties", base, [env.base_model.state_dict()], density=0.5, progress=False))


def merge_api_nan_task_vector(env):
    task_vector = TaskVector({BROKEN: torch.full(env.base_model.state_dict()[BROKEN].shape, float("nan"))})
    return Api(lambda: merge("task_arithmetic", env.base_model, [task_vector], progress=False))


def merge_api_result_overflows(env):
    expert = _expert_state(env, lambda state: state[BROKEN].add_(1.0))
    return Api(lambda: merge("task_arithmetic", env.base_model, [expert], lam=1e30, weights=[1e30], progress=False))


def merge_api_int64_expert(env):
    state = {name: (tensor * 100).long() for name, tensor in env.base_model.state_dict().items()}
    return Api(lambda: merge("task_arithmetic", env.base_model, [state], progress=False))


def task_vector_cli_inf_expert(env):
    return Cli(["task-vector", str(env.checkpoints / "base"), _inf_expert(env)])


def task_vector_cli_nan_adapter(env):
    return Cli(["task-vector", str(env.checkpoints / "base"), _nan_adapter(env), "--quiet"])  # the base loads first


def task_vector_api_nan_checkpoint(env):
    folder = _nan_expert(env)
    return Api(lambda: TaskVector.from_checkpoints(env.checkpoints / "base", folder))


def task_vector_api_nan_lora(env):
    folder = _nan_adapter(env)
    return Api(lambda: TaskVector.from_lora(env.base_model, folder))


def combine_lora_nan_adapter(env):
    adapters = {"ab": _nan_adapter(env), "cd": str(env.lora_dirs["cd"])}
    return Api(lambda: combine_lora_adapters(env.base_model, adapters, env.tmp / "combined"))


# ---- mergekit YAML checked by our rules before mergekit runs ----------------------------------


def _with_model_parameters(env, **parameters) -> dict:
    config = _mergekit(env, merge_method="ties")
    config["models"][0]["parameters"].update(parameters)
    return config


def mergekit_density_negative(env):
    return _merge_cli(env, _with_model_parameters(env, density=-0.5))


def mergekit_density_two(env):
    return _merge_cli(env, _with_model_parameters(env, density=2.0))


def mergekit_lambda_nan(env):
    return _merge_cli(env, _mergekit(env, parameters={"lambda": float("nan")}))


def mergekit_weight_inf(env):
    return _merge_cli(env, _with_model_parameters(env, weight=float("inf")))


def mergekit_dare_density_zero(env):
    config = _mergekit(env, merge_method="dare_ties")
    config["parameters"]["density"] = 0.0  # every entry dropped: the output is the base
    return _merge_cli(env, config)


def mergekit_gradient_point_out_of_range(env):
    return _merge_cli(env, _with_model_parameters(env, density=[0.5, 1.5]))


def mergekit_unknown_method(env):
    return _merge_cli(env, _mergekit(env, merge_method="task_arithmatic"))


def mergekit_misspelt_parameter(env):
    return _merge_cli(env, _mergekit(env, parameters={"lamda": 0.5}))


def mergekit_api_density_two(env):
    config = _with_model_parameters(env, density=2.0)
    return Api(lambda: merge_checkpoints(config, env.tmp / "out"))


# ---- checkpoints that do not fit, adapters where checkpoints belong -----------------------------


def merge_cli_lora_as_model(env):
    return _merge_cli(env, _mergekit(env, env.checkpoints / "expert_0", env.lora_dirs["ab"]))


def merge_cli_lora_as_base_our_config(env):
    config = {
        "method": "task_arithmetic",
        "base": str(env.lora_dirs["ab"]),
        "experts": [str(env.checkpoints / "expert_0")],
    }
    return _merge_cli(env, config)


def merge_cli_empty_base(env):
    (env.tmp / "empty").mkdir()
    return _merge_cli(env, _mergekit(env, base_model=str(env.tmp / "empty")))


def merge_cli_hidden_size_mismatch(env):
    return _merge_cli(env, _mergekit(env, _other_shape(env, hidden_size=16)))


def merge_cli_vocabulary_mismatch(env):
    return _merge_cli(env, _mergekit(env, _other_shape(env, hidden_size=32, vocab_size=80)))


def merge_api_hidden_size_mismatch(env):
    config = _mergekit(env, _other_shape(env, hidden_size=16))
    return Api(lambda: merge_checkpoints(config, env.tmp / "out"))


def task_vector_cli_adapter_for_another_base(env):
    other = random_llama(tiny_llama_config(hidden_size=48, num_heads=2), seed=4)
    adapter = random_lora_adapter(other, env.tmp / "adapter_h48", seed=5)
    return Cli(["task-vector", str(env.checkpoints / "base"), str(adapter), "--quiet"])  # the base loads first


def combine_lora_checkpoint_as_adapter(env):
    adapters = {"ab": str(env.lora_dirs["ab"]), "full": str(env.checkpoints / "expert_0")}
    return Api(lambda: combine_lora_adapters(env.base_model, adapters, env.tmp / "combined"))


# ---- merge grids of a compare config, validated before any training ----------------------------


def _compare(env, change) -> Cli:
    with open(Path(__file__).parents[3] / "configs" / "letters.yaml") as handle:
        config = yaml.safe_load(handle)
    change(config)
    return Cli(["compare", _write(env, "letters.yaml", config), "--out", str(env.tmp / "run")])


def grid_density_negative(env):
    return _compare(env, lambda config: config["merges"]["ties"].update(density=[0.5, -0.5]))


def grid_density_above_one(env):
    return _compare(env, lambda config: config["merges"]["ties"].update(density=[1.5]))


def grid_lambda_nan(env):
    return _compare(env, lambda config: config["merges"]["task_arithmetic"].update(lam=[0.5, float("nan")]))


def grid_drop_rate_one(env):
    return _compare(env, lambda config: config["merges"]["dare_ties"].update(drop_rate=[1.0]))


def grid_lr_inf(env):
    return _compare(env, lambda config: config["training"]["experts"]["full"].update(lr=float("inf")))


def grid_lora_alpha_nan(env):
    return _compare(env, lambda config: config["training"]["experts"]["lora"].update(alpha=float("nan")))


def grid_variant_lr_inf(env):
    return _compare(
        env, lambda config: config["variants"]["contiguous"].update(training={"base": {"steps": 5, "lr": float("inf")}})
    )


def grid_negative_evaluation_seed(env):
    return _compare(env, lambda config: config["evaluation"].update(seed=-1))


NONFINITE = r"non-finite weights: tensor `model\.layers\.0\.mlp\.up_proj\.weight`"

CASES = [
    Case(
        "merge-cli-nan-expert",
        "silent",
        merge_cli_nan_expert,
        r"nan_expert'? has " + NONFINITE + r".*--allow-nonfinite",
    ),
    Case(
        "merge-cli-inf-expert-our-config", "silent", merge_cli_inf_expert_our_config, r"inf_expert'? has " + NONFINITE
    ),
    Case(
        "merge-cli-result-overflows",
        "silent",
        merge_cli_result_overflows,
        r"merged model has non-finite weights.*overflow",
    ),
    Case("merge-cli-int64-expert", "silent", merge_cli_int64_expert, r"dtype mismatch for tensor `.*`.*int64_expert"),
    Case("merge-api-nan-expert", "silent", merge_api_nan_expert, r"finetuned_or_task_vectors\[0\].*" + NONFINITE),
    Case("merge-api-inf-base", "silent", merge_api_inf_base, r"`base` has " + NONFINITE),
    Case(
        "merge-api-nan-task-vector",
        "silent",
        merge_api_nan_task_vector,
        r"finetuned_or_task_vectors\[0\] has " + NONFINITE,
    ),
    Case(
        "merge-api-result-overflows",
        "silent",
        merge_api_result_overflows,
        r"merged model has non-finite weights.*overflow",
    ),
    Case(
        "merge-api-int64-expert",
        "silent",
        merge_api_int64_expert,
        r"dtype mismatch for tensor `.*`: base has torch\.float32, finetuned has torch\.int64",
    ),
    Case("task-vector-cli-inf-expert", "silent", task_vector_cli_inf_expert, r"inf_expert'? has " + NONFINITE),
    Case(
        "task-vector-cli-nan-adapter",
        "silent",
        task_vector_cli_nan_adapter,
        r"adapter .*nan_adapter'? has non-finite weights: tensor `.*lora_A",
    ),
    Case("task-vector-api-nan-checkpoint", "silent", task_vector_api_nan_checkpoint, r"nan_expert'? has " + NONFINITE),
    Case("task-vector-api-nan-lora", "silent", task_vector_api_nan_lora, r"nan_adapter'? has non-finite weights"),
    Case(
        "combine-lora-nan-adapter", "silent", combine_lora_nan_adapter, r"adapter `ab`.*nan_adapter.*non-finite weights"
    ),
    Case(
        "mergekit-density-negative",
        "silent",
        mergekit_density_negative,
        r"`models\[0\]\.parameters\.density` must be in \(0, 1\], got -0\.5",
    ),
    Case(
        "mergekit-density-two",
        "silent",
        mergekit_density_two,
        r"`models\[0\]\.parameters\.density` must be in \(0, 1\], got 2\.0",
    ),
    Case(
        "mergekit-lambda-nan", "silent", mergekit_lambda_nan, r"`parameters\.lambda` must be a finite number, got nan"
    ),
    Case(
        "mergekit-weight-inf",
        "silent",
        mergekit_weight_inf,
        r"`models\[0\]\.parameters\.weight` must be a finite number, got inf",
    ),
    Case(
        "mergekit-dare-density-zero",
        "silent",
        mergekit_dare_density_zero,
        r"`parameters\.density` must be in \(0, 1\], got 0\.0",
    ),
    Case(
        "mergekit-gradient-point-out-of-range",
        "silent",
        mergekit_gradient_point_out_of_range,
        r"density` must be in \(0, 1\], got 1\.5",
    ),
    Case(
        "mergekit-unknown-method",
        "traceback",
        mergekit_unknown_method,
        r"`merge_method` 'task_arithmatic' is not a method mergekit runs; valid: .*task_arithmetic",
    ),
    Case(
        "mergekit-misspelt-parameter",
        "silent",
        mergekit_misspelt_parameter,
        r"`parameters\.lamda` is not a parameter of mergekit's `task_arithmetic`; valid: .*lambda",
    ),
    Case("mergekit-api-density-two", "silent", mergekit_api_density_two, r"density` must be in \(0, 1\], got 2\.0"),
    Case(
        "merge-cli-lora-as-model",
        "misleading",
        merge_cli_lora_as_model,
        r"`models\[1\]\.model` .* is a peft adapter folder, not a full checkpoint",
    ),
    Case(
        "merge-cli-lora-as-base-our-config",
        "misleading",
        merge_cli_lora_as_base_our_config,
        r"`base_model` .* is a peft adapter folder, not a full checkpoint",
    ),
    Case(
        "merge-cli-empty-base",
        "misleading",
        merge_cli_empty_base,
        r"`base_model` .*empty' is not a model folder: it has no config\.json \(the folder is empty\)",
    ),
    Case(
        "merge-cli-hidden-size-mismatch",
        "misleading",
        merge_cli_hidden_size_mismatch,
        r"shape mismatch for tensor `.*`: `base_model` .* has \(\d+, 32\), "
        r"`models\[0\]\.model` .*other_h16_v64' has \(\d+, 16\)",
    ),
    Case(
        "merge-cli-vocabulary-mismatch",
        "misleading",
        merge_cli_vocabulary_mismatch,
        r"vocabulary sizes differ: `base_model` .* has 64 tokens and `models\[0\]\.model` .* has 80",
    ),
    Case(
        "merge-api-hidden-size-mismatch",
        "misleading",
        merge_api_hidden_size_mismatch,
        r"shape mismatch for tensor .*\(\d+, 32\).*\(\d+, 16\)",
    ),
    Case(
        "task-vector-cli-adapter-for-another-base",
        "misleading",
        task_vector_cli_adapter_for_another_base,
        r"adapter .*adapter_h48.* was made for another base: its `.*` has shape \(4, \d+\), "
        r"but the base's `.*` has shape \(32, \d+\)",
    ),
    Case(
        "combine-lora-checkpoint-as-adapter",
        "traceback",
        combine_lora_checkpoint_as_adapter,
        r"`adapters\['full'\]` .*expert_0' is a full checkpoint, not a peft adapter folder",
    ),
    Case(
        "grid-density-negative",
        "traceback",
        grid_density_negative,
        r"merges\.ties.*`density` must be in \(0, 1\], got -0\.5",
    ),
    Case(
        "grid-density-above-one",
        "traceback",
        grid_density_above_one,
        r"merges\.ties.*`density` must be in \(0, 1\], got 1\.5",
    ),
    Case("grid-lambda-nan", "traceback", grid_lambda_nan, r"merges\.task_arithmetic\.lam.*finite number \(got nan\)"),
    Case(
        "grid-drop-rate-one",
        "traceback",
        grid_drop_rate_one,
        r"merges\.dare_ties.*`drop_rate` must be in \[0, 1\), got 1\.0",
    ),
    Case(
        "grid-lr-inf",
        "silent",
        grid_lr_inf,
        r"training\.experts\.full\.lr: Input should be a finite number \(got inf\)",
    ),
    Case(
        "grid-lora-alpha-nan",
        "silent",
        grid_lora_alpha_nan,
        r"training\.experts\.lora\.alpha: Input should be a finite number \(got nan\)",
    ),
    Case(
        "grid-variant-lr-inf",
        "silent",
        grid_variant_lr_inf,
        r"variants\.contiguous.*training\.base\.lr: Input should be a finite number",
    ),
    Case(
        "grid-negative-evaluation-seed",
        "traceback",
        grid_negative_evaluation_seed,
        r"evaluation\.seed: Input should be greater than or equal to 0 \(got -1\)",
    ),
]
