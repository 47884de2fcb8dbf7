"""`merge_checkpoints`: merges of checkpoints on disk, through mergekit's `run_merge`.

On disk the definitions are mergekit's (what `merge(..., **MERGEKIT_MODE)` computes in memory):
TIES trims per tensor and applies the weights before the sign election; DARE rescales to the L1
norm; dare_ties does not normalise.

Before mergekit runs, everything it would accept silently or report misleadingly is checked: a
mergekit YAML's parameters by the same rules as our config (`check_mergekit_parameters`), each
model folder (`mergecompose.core.boundary`: missing, an adapter, no config.json, a truncated or
missing weights file), and the local
checkpoints' tensors (`check_checkpoints`: shapes, float / integer kinds, NaN and inf). A merged
model that comes out non-finite is not written.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import torch
import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator
from safetensors import safe_open

from mergecompose.core.boundary import check_adapter, check_checkpoint, check_text_file
from mergecompose.core.import_paths import is_import_path
from mergecompose.core.io import atomic_output_dir, read_yaml_mapping, refuse_existing, refuse_output_over_inputs
from mergecompose.core.sources import is_local
from mergecompose.merging.lazy_tensors import SafetensorsCheckpoint
from mergecompose.merging.merge import MERGEKIT_MODE
from mergecompose.merging.method_settings import MergeSettings, readable_error
from mergecompose.merging.methods import METHODS, mergekit_methods, validate_merge_params
from mergecompose.merging.state_dicts import check_finite

if TYPE_CHECKING:
    from mergekit.common import ModelReference
    from mergekit.config import MergeConfiguration
    from mergekit.options import MergeOptions
    from typing_extensions import Self

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# On disk the definitions are mergekit's: these keywords are fixed to its values.
_FIXED_ON_DISK = {**MERGEKIT_MODE, "sign_election": "mass"}
# mergekit's parameter names -> ours (`mergecompose.merging.method_settings`); the others mergekit checks itself.
_OUR_NAMES = {"weight": "weights", "lambda": "lam", "density": "density", "gamma": "gamma", "normalize": "normalize"}
_ADAPTER_HINT = (
    "mergekit merges full checkpoints: give it on its base as `BASE+ADAPTER` (mergekit's syntax), or save "
    "base + ΔW first (`TaskVector.from_lora(base, adapter).apply_to(base)`)"
)


class ExpertCheckpoint(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    weight: float = 1.0


class CheckpointMergeConfig(BaseModel):
    """Our typed merge config; `to_mergekit()` translates it into mergekit's schema.

    Example (YAML):

        method: ties
        base: checkpoints/base
        experts: [{path: checkpoints/math, weight: 1.0}, checkpoints/code]
        density: 0.2
        lam: 1.0

    `method` is one mergekit runs (`mergecompose.merging.methods.mergekit_methods()`), or a user's method as
    an import path `package.module:Name`, which runs in memory (`mergecompose.merging.in_memory_checkpoints`);
    the other keys are the method's parameters, validated by its settings model when the config is.
    """

    model_config = ConfigDict(extra="allow")  # the extra keys are the method's parameters

    method: str
    base: str
    experts: list[ExpertCheckpoint]
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"

    @field_validator("method")
    @classmethod
    def _mergekit_runs_it(cls, value: str) -> str:
        if value not in mergekit_methods() and not is_import_path(value):
            raise ValueError(f"must be one of the methods mergekit runs, {mergekit_methods()}")
        return value

    @field_validator("experts", mode="before")
    @classmethod
    def _paths_as_experts(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"path": item} if isinstance(item, (str, os.PathLike)) else item for item in value]
        return value

    @field_validator("experts")
    @classmethod
    def _at_least_one(cls, value: list[ExpertCheckpoint]) -> list[ExpertCheckpoint]:
        if not value:
            raise ValueError("must list at least one checkpoint")
        return value

    @model_validator(mode="after")
    def _parameters_are_valid(self) -> Self:
        self.settings()
        return self

    def settings(self) -> MergeSettings:
        """The resolved settings under mergekit's definitions (checks every parameter)."""
        parameters = dict(self.model_extra or {})  # extra="allow": always a dict
        for name, value in parameters.items():
            if name == "weights":
                raise ValueError(
                    "`weights` are given per expert (`experts: [{path: ..., weight: ...}]`), not as a list"
                )
            if name in _FIXED_ON_DISK and value != _FIXED_ON_DISK[name]:
                raise ValueError(
                    f"`{name}` is {_FIXED_ON_DISK[name]!r} on disk (mergekit's definition), got {value!r}; "
                    "merge in memory (`mergecompose.merging.merge`) for the other definitions"
                )
        weights = [expert.weight for expert in self.experts]
        if is_import_path(self.method):  # in memory: the conventions are the user method's own
            return validate_merge_params(self.method, {**parameters, "weights": weights}, count=len(weights))
        return validate_merge_params(
            self.method, {**parameters, **MERGEKIT_MODE, "weights": weights}, count=len(weights)
        )

    def to_mergekit(self) -> dict:
        """The same merge in mergekit's YAML schema (not for a user's method, which mergekit cannot run)."""
        if is_import_path(self.method):
            raise ValueError(
                f"`method` {self.method!r} is your own merge method, which runs in memory, not in mergekit: "
                "`mergecompose merge` runs it so, or `mergecompose.merging.in_memory_checkpoints.merge_in_memory`"
            )
        settings = self.settings().model_dump()
        models = []
        for expert in self.experts:
            parameters = {"weight": expert.weight}
            if settings.get("drop_rate") is not None:
                parameters["density"] = 1.0 - settings["drop_rate"]
            elif settings.get("density") is not None:
                parameters["density"] = settings["density"]
            if "gamma" in settings:
                parameters["gamma"] = settings["gamma"]
            models.append({"model": expert.path, "parameters": parameters})
        config: dict[str, Any] = {"merge_method": self.method, "models": models, "dtype": self.dtype}
        if self.method == "linear":
            config["parameters"] = {"normalize": settings["normalize"]}
            return config
        config["base_model"] = self.base
        config["parameters"] = {"lambda": settings["lam"], "normalize": settings["normalize"]}
        if "drop_rate" in settings:
            config["parameters"]["rescale"] = True  # L1 rescaling; mergekit's only DARE rescale
        return config


# What `merge_checkpoints` takes: a YAML file, a dict (mergekit's schema or ours) or our typed config.
MergeConfigSource: TypeAlias = str | os.PathLike | Mapping[str, Any] | CheckpointMergeConfig


def load_merge_config(config: MergeConfigSource) -> tuple[dict, CheckpointMergeConfig | None]:
    """(mergekit dict, our typed config or None) from a YAML path, a dict or a CheckpointMergeConfig.

    A dict (or YAML file) with `merge_method` is mergekit's schema and is passed on unchanged;
    one with `method` is ours.
    """
    if isinstance(config, CheckpointMergeConfig):
        return config.to_mergekit(), config
    if isinstance(config, (str, os.PathLike)):
        config = read_yaml_mapping(check_text_file(config, "config"), "merge config")
    if not isinstance(config, Mapping):
        raise ValueError(
            "`config` must be a YAML file, a dict in mergekit's schema (with `merge_method`) or ours "
            f"(with `method`), or a CheckpointMergeConfig; got {type(config).__name__}"
        )
    if "merge_method" in config:
        check_mergekit_parameters(config)
        return dict(config), None
    if "method" in config:
        try:
            ours = CheckpointMergeConfig.model_validate(dict(config))
        except ValidationError as error:
            raise readable_error(error, CheckpointMergeConfig, "the merge config") from None
        return ours.to_mergekit(), ours
    raise ValueError(f"`config` has neither `merge_method` (mergekit) nor `method` (ours); keys: {sorted(config)}")


@dataclass(frozen=True)
class PreparedMerge:
    """A merge checked and ready for mergekit: its configuration, the mergekit-schema dict, our config (if it
    was ours) and mergekit's options."""

    configuration: MergeConfiguration
    mergekit_dict: dict
    ours: CheckpointMergeConfig | None
    options: MergeOptions


def prepare_merge(
    config: MergeConfigSource,
    out_dir: str | os.PathLike,
    overwrite: bool = False,
    *,
    options: Mapping | None = None,
    allow_nonfinite: bool = False,
) -> PreparedMerge:
    """Every check `merge_checkpoints` makes before mergekit runs, and nothing written: the config (ours or
    mergekit's), every model and adapter through the loading boundary, the checkpoints' agreement and (unless
    `allow_nonfinite`) finiteness, the output folder against the inputs, and mergekit's options (a `device`
    this machine lacks is refused here, not in mergekit). `mergecompose merge --check` runs this alone."""
    from mergekit.config import MergeConfiguration
    from mergekit.options import MergeOptions

    mergekit_dict, ours = load_merge_config(config)
    try:
        merge_configuration = MergeConfiguration.model_validate(mergekit_dict)
    except (ValidationError, RuntimeError) as error:  # mergekit's own validators raise RuntimeError
        raise ValueError(f"the merge config is not valid for mergekit: {' '.join(str(error).split())}") from None
    models = {}
    for label, reference in _labelled_models(merge_configuration):
        # mergekit takes a missing local folder for a hub id, and an adapter for a broken model; say what is wrong.
        models[label] = check_checkpoint(str(reference.model.path), label, adapter_hint=_ADAPTER_HINT)
        if reference.lora is not None:
            check_adapter(str(reference.lora.path), f"{label} (its LoRA)")
    vocabulary_may_differ = bool(mergekit_dict.get("tokenizer_source") or mergekit_dict.get("tokenizer"))
    check_checkpoints(
        {label: path for label, path in models.items() if is_local(path)}, allow_nonfinite, vocabulary_may_differ
    )
    sources = list(models.values())
    config_file = [config] if isinstance(config, (str, os.PathLike)) else []
    refuse_output_over_inputs(out_dir, [*sources, *config_file])
    refuse_existing(out_dir, overwrite)
    defaults: dict[str, Any] = {"copy_tokenizer": _has_tokenizer(mergekit_dict), "quiet": False}
    seed = (ours.model_extra or {}).get("seed") if ours is not None else None
    if seed is not None:
        defaults["random_seed"] = seed
    try:
        merge_options = MergeOptions(**{**defaults, **dict(options or {})})
    except ValidationError as error:
        raise readable_error(error, MergeOptions, "mergekit's options") from None
    _check_device(merge_options.device)
    return PreparedMerge(merge_configuration, mergekit_dict, ours, merge_options)


def _check_device(device: str) -> None:
    """Refuse a mergekit `device` this machine does not have (mergekit fails on it deep inside with an assertion)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"mergekit's `device` {device!r} needs CUDA, which this machine lacks; use 'cpu'")


def merge_checkpoints(
    config: MergeConfigSource,
    out_dir: str | os.PathLike,
    overwrite: bool = False,
    *,
    options: Mapping | None = None,
    allow_nonfinite: bool = False,
) -> Path:
    """Run mergekit's `run_merge` on local checkpoints and write the result atomically to `out_dir`.

    `config` is a mergekit YAML file, a dict in mergekit's schema, or our `CheckpointMergeConfig`
    (or its dict / YAML form), which is translated. `options` are mergekit `MergeOptions` fields
    (e.g. {"device": "cuda"}); by default the tokenizer is copied only if the base (or first)
    model folder has one, and our config's `seed` becomes `random_seed`.

    Checked before mergekit runs (ValueError naming the model and the tensor): every model folder
    exists and is a full checkpoint (a LoRA adapter is named as one), and the local safetensors
    checkpoints agree on every shared tensor's shape (a vocabulary mismatch names both sizes)
    and kind, and, unless `allow_nonfinite`, hold no NaN or inf (this reads every tensor once).
    A merged model with NaN or inf is then not written either.

    The merge runs into a temporary folder next to `out_dir`, which is renamed on success; a
    failure leaves nothing at `out_dir`. The output holds mergekit's files (config.json,
    model*.safetensors, mergekit_config.yml) and, for our config, `mergecompose_config.yaml`;
    it loads with `AutoModelForCausalLM.from_pretrained`.
    """
    from mergekit.card import generate_card
    from mergekit.merge import run_merge

    prepared = prepare_merge(config, out_dir, overwrite, options=options, allow_nonfinite=allow_nonfinite)
    merge_configuration, mergekit_dict, ours = prepared.configuration, prepared.mergekit_dict, prepared.ours
    config_source = yaml.safe_dump(mergekit_dict, sort_keys=False)
    merge_options = prepared.options
    with contextlib.ExitStack() as stack, atomic_output_dir(out_dir, overwrite) as folder:
        if merge_options.lora_merge_cache is None and _merges_adapters(merge_configuration):
            # mergekit merges each `base+adapter` model into a folder of this cache first, and needs one given.
            cache = stack.enter_context(tempfile.TemporaryDirectory(prefix="mergecompose-lora-", dir=folder.parent))
            # Its model card would look each `base+adapter` path up on the hub: none is written for these.
            merge_options = merge_options.model_copy(update={"lora_merge_cache": cache, "write_model_card": False})
        run_merge(merge_configuration, str(folder), merge_options, config_source=config_source)
        if (
            folder / "README.md"
        ).is_file():  # mergekit titles its model card with the folder it wrote: ours is temporary
            card = generate_card(config=merge_configuration, config_yaml=config_source, name=Path(out_dir).name)
            (folder / "README.md").write_text(card, encoding="utf-8")
        if not allow_nonfinite:
            _check_merged_output(folder)
        if ours is not None:
            (folder / "mergecompose_config.yaml").write_text(yaml.safe_dump(ours.model_dump(), sort_keys=False))
    return Path(out_dir)


def _merges_adapters(configuration: MergeConfiguration) -> bool:
    """Whether a model of the merge is a `base+adapter` reference (mergekit merges the adapter in first)."""
    return any(reference.lora is not None for reference in configuration.referenced_models())


def _has_tokenizer(mergekit_dict: Mapping) -> bool:
    """Whether the model mergekit takes the tokenizer from has tokenizer files (hub ids: assume so)."""
    source = mergekit_dict.get("base_model") or next(
        (model["model"] for model in mergekit_dict.get("models") or [] if isinstance(model, Mapping)), None
    )
    if not isinstance(source, str) or not Path(source).is_dir():
        return True
    return any((Path(source) / name).exists() for name in _TOKENIZER_FILES)


# ---- checks before mergekit runs --------------------------------------------------------------


def check_mergekit_parameters(config: Mapping) -> None:
    """Check a mergekit-schema config's method and every parameter value by our rules, before mergekit runs.

    mergekit passes density −0.5 (the output is the base), density 2.0, λ NaN (every weight NaN)
    and misspelt parameter names on without a word. Here: the method must be one mergekit runs;
    each parameter name one the method takes (mergekit's own list); every number finite; and for
    a method we define too (`mergecompose.merging.methods.mergekit_methods()`), every value of `weight`,
    `lambda`, `density`, `gamma` and `normalize` (each point of a gradient or filter list, at the
    top level, per model and per slice) valid for our settings model under mergekit's definitions.
    """
    from mergekit.merge_methods import registry as mergekit_registry

    check_mergekit_keys(config)
    method: Any = config.get("merge_method")  # a YAML value, checked against mergekit's methods next
    known = {entry.spec.name: entry.spec for entry in mergekit_registry.registered_methods()}
    if method not in known:
        raise ValueError(f"`merge_method` {method!r} is not a method mergekit runs; valid: {', '.join(sorted(known))}")
    accepted = [parameter.name for parameter in known[method].parameters]
    ours = method in mergekit_methods()
    for where, parameters in _parameter_blocks(config):
        if not isinstance(parameters, Mapping):
            raise ValueError(f"`{where}` must be a mapping of parameter names to values, got {parameters!r}")
        for name, setting in parameters.items():
            if name not in accepted:
                raise ValueError(
                    f"`{where}.{name}` is not a parameter of mergekit's `{method}`; valid: {', '.join(accepted)}"
                )
            for value in _setting_values(setting):
                _check_parameter_value(method, f"{where}.{name}", name, value, ours)


def check_mergekit_keys(config: Mapping) -> None:
    """Refuse a top-level key of a mergekit-schema config that mergekit's `MergeConfiguration` has no field for.

    mergekit ignores such a key, so `modelz:` for `models:` ends in "Exactly one of 'models', 'slices',
    or 'modules' must be present"; here the key is named with the field it is closest to.
    """
    from mergekit.config import MergeConfiguration

    fields = list(MergeConfiguration.model_fields)
    for key in config:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"did you mean `{close[0]}`? " if close else ""
            raise ValueError(
                f"the merge config's top-level key `{key}` is not one mergekit reads; {hint}valid: {', '.join(fields)}"
            )


def _parameter_blocks(config: Mapping) -> Iterator[tuple[str, object]]:
    """(where, parameters) of every `parameters:` block.

    Top level, per model, per slice and slice source, and per module.
    """
    if config.get("parameters") is not None:
        yield "parameters", config["parameters"]
    yield from _models_and_slices(config, "")
    for module_name, module in (config.get("modules") or {}).items():
        if isinstance(module, Mapping):
            if module.get("parameters") is not None:
                yield f"modules.{module_name}.parameters", module["parameters"]
            yield from _models_and_slices(module, f"modules.{module_name}.")


def _models_and_slices(block: Mapping, prefix: str) -> Iterator[tuple[str, object]]:
    for key in ("models", "slices"):
        if block.get(key) is not None and not isinstance(block[key], list):
            raise ValueError(f"`{prefix}{key}` must be a list of mappings, got {block[key]!r}")
    for index, model in enumerate(block.get("models") or []):
        if isinstance(model, Mapping) and model.get("parameters") is not None:
            yield f"{prefix}models[{index}].parameters", model["parameters"]
    for index, piece in enumerate(block.get("slices") or []):
        if not isinstance(piece, Mapping):
            continue
        if piece.get("parameters") is not None:
            yield f"{prefix}slices[{index}].parameters", piece["parameters"]
        for source_index, source in enumerate(piece.get("sources") or []):
            if isinstance(source, Mapping) and source.get("parameters") is not None:
                yield f"{prefix}slices[{index}].sources[{source_index}].parameters", source["parameters"]


def _setting_values(setting: object) -> list[object]:
    """The scalars of a mergekit parameter setting: a value, a gradient list, or filter entries `{filter, value}`."""
    if isinstance(setting, Mapping):
        return _setting_values(setting.get("value"))
    if isinstance(setting, list):
        return [value for item in setting for value in _setting_values(item)]
    return [setting]


def _as_number(value: object) -> object:
    """YAML reads `1e-3` as a string; mergekit takes it as a number, and so do we."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _check_parameter_value(method: str, where: str, name: str, value: object, ours: bool) -> None:
    value = _as_number(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"`{where}` must be a finite number, got {value!r}")
    if not ours or name not in _OUR_NAMES:
        return
    ours_name = _OUR_NAMES[name]
    # mergekit's defaults for what a single value does not give: density 1 (nothing dropped).
    params: dict[str, object] = dict(MERGEKIT_MODE)
    if "density" in METHODS[method].settings.model_fields:
        params["density"] = 1.0
    params[ours_name] = [value] if ours_name == "weights" else value
    try:
        validate_merge_params(method, params)
    except ValueError as error:
        reason = str(error).replace(f"`{ours_name}[0]`", f"`{name}`").replace(f"`{ours_name}`", f"`{name}`")
        raise ValueError(f"`{where}` {reason.removeprefix(f'`{name}` ')}") from None


def _labelled_models(configuration: MergeConfiguration) -> list[tuple[str, ModelReference]]:
    """(where in the config, mergekit ModelReference) of every model a mergekit configuration reads."""
    labelled = []
    if configuration.base_model is not None:
        labelled.append(("base_model", configuration.base_model))
    blocks = [("", configuration)] + [
        (f"modules.{name}.", module) for name, module in (configuration.modules or {}).items()
    ]
    for prefix, block in blocks:
        for index, model in enumerate(block.models or []):
            labelled.append((f"{prefix}models[{index}].model", model.model))
        for index, piece in enumerate(block.slices or []):
            for source_index, source in enumerate(piece.sources):
                labelled.append((f"{prefix}slices[{index}].sources[{source_index}].model", source.model))
    seen, unique = set(), []
    for label, reference in labelled:
        if reference not in seen:
            seen.add(reference)
            unique.append((label, reference))
    return unique


def check_checkpoints(
    folders: Mapping[str, str], allow_nonfinite: bool = False, vocabulary_may_differ: bool = False
) -> None:
    """Compare local safetensors checkpoints (label -> folder) with the first one, tensor by tensor.

    A tensor both hold must have the same shape (for the embeddings of a different vocabulary,
    the error names both sizes, unless `vocabulary_may_differ`: mergekit's tokenizer merging) and
    both be floating-point or both not; unless `allow_nonfinite`, no tensor may hold NaN or inf.
    Folders without safetensors files are left to mergekit.
    """
    readable = {
        label: folder
        for label, folder in folders.items()
        if any(Path(folder).expanduser().glob("*.safetensors"))
        or (Path(folder).expanduser() / "model.safetensors.index.json").is_file()
    }
    checkpoints = {label: SafetensorsCheckpoint(folder, label) for label, folder in readable.items()}
    if not checkpoints:
        return
    first_label, first = next(iter(checkpoints.items()))
    for label, checkpoint in checkpoints.items():
        for name in checkpoint.keys():
            if label != first_label and name in first:
                _check_pair(
                    name,
                    (first_label, readable[first_label], first),
                    (label, readable[label], checkpoint),
                    vocabulary_may_differ,
                )
            if not allow_nonfinite and checkpoint.is_floating_point(name):
                check_finite(name, checkpoint.get(name), f"`{label}` {readable[label]!r}")


def _check_pair(
    name: str,
    first: tuple[str, str, SafetensorsCheckpoint],
    second: tuple[str, str, SafetensorsCheckpoint],
    vocabulary_may_differ: bool,
) -> None:
    (first_label, first_folder, first_checkpoint), (label, folder, checkpoint) = first, second
    shapes = first_checkpoint.shape(name), checkpoint.shape(name)
    if shapes[0] != shapes[1]:
        embedding = any(part in name for part in ("embed", "lm_head", "wte"))
        if embedding and len(shapes[0]) == 2 and shapes[0][1:] == shapes[1][1:]:
            if vocabulary_may_differ:
                return
            raise ValueError(
                f"vocabulary sizes differ: `{first_label}` {first_folder!r} has {shapes[0][0]} tokens and `{label}` "
                f"{folder!r} has {shapes[1][0]} (tensor `{name}`); merge models that share one tokenizer, or set "
                "mergekit's `tokenizer_source`"
            )
        raise ValueError(
            f"shape mismatch for tensor `{name}`: `{first_label}` {first_folder!r} has {shapes[0]}, "
            f"`{label}` {folder!r} has {shapes[1]}; the models have different architectures (e.g. hidden sizes) "
            "and cannot be merged"
        )
    if first_checkpoint.is_floating_point(name) != checkpoint.is_floating_point(name):
        kinds = ["floating-point" if c.is_floating_point(name) else "integer" for c in (first_checkpoint, checkpoint)]
        raise ValueError(
            f"dtype mismatch for tensor `{name}`: `{first_label}` {first_folder!r} stores it as {kinds[0]}, `{label}` "
            f"{folder!r} as {kinds[1]}; weights are merged only between floating-point tensors"
        )


def _check_merged_output(folder: Path) -> None:
    """Refuse a merged model with NaN or inf (finite inputs: λ or the weights overflowed the dtype)."""
    hint = (
        "the inputs are finite, so the merge overflowed its dtype: lower `lambda` or the weights; nothing was written"
    )
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                check_finite(name, handle.get_tensor(name), "the merged model", hint)
