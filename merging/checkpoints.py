"""`merge_checkpoints`: merges of checkpoints on disk, through mergekit's `run_merge`.

On disk the definitions are mergekit's (what `merge(..., **MERGEKIT_MODE)` computes in memory):
TIES trims per tensor and applies the weights before the sign election; DARE rescales to the L1
norm; dare_ties does not normalise.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from composition.io import atomic_output_dir, read_yaml_mapping, refuse_existing, refuse_output_over_inputs
from merging.merge import MERGEKIT_MODE
from merging.registry import mergekit_methods, validate_merge_params
from merging.settings import MergeSettings, readable_error

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# On disk the definitions are mergekit's: these keywords are fixed to its values.
_FIXED_ON_DISK = {**MERGEKIT_MODE, "sign_election": "mass"}


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

    `method` is one mergekit runs (`merging.registry.mergekit_methods()`); the other keys are
    the method's parameters, validated by its settings model (`METHODS[method].settings`) when
    the config is.
    """

    model_config = ConfigDict(extra="allow")  # the extra keys are the method's parameters

    method: str
    base: str
    experts: list[ExpertCheckpoint]
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"

    @field_validator("method")
    @classmethod
    def _mergekit_runs_it(cls, value):
        if value not in mergekit_methods():
            raise ValueError(f"must be one of the methods mergekit runs, {mergekit_methods()}")
        return value

    @field_validator("experts", mode="before")
    @classmethod
    def _paths_as_experts(cls, value):
        if isinstance(value, list):
            return [{"path": item} if isinstance(item, (str, os.PathLike)) else item for item in value]
        return value

    @field_validator("experts")
    @classmethod
    def _at_least_one(cls, value):
        if not value:
            raise ValueError("must list at least one checkpoint")
        return value

    @model_validator(mode="after")
    def _parameters_are_valid(self):
        self.settings()
        return self

    def settings(self) -> MergeSettings:
        """The resolved settings under mergekit's definitions (checks every parameter)."""
        parameters = dict(self.model_extra)
        for name, value in parameters.items():
            if name == "weights":
                raise ValueError("`weights` are given per expert (`experts: [{path: ..., weight: ...}]`), not as a list")
            if name in _FIXED_ON_DISK and value != _FIXED_ON_DISK[name]:
                raise ValueError(
                    f"`{name}` is {_FIXED_ON_DISK[name]!r} on disk (mergekit's definition), got {value!r}; "
                    "merge in memory (`merging.merge`) for the other definitions"
                )
        weights = [expert.weight for expert in self.experts]
        return validate_merge_params(self.method, {**parameters, **MERGEKIT_MODE, "weights": weights}, count=len(weights))

    def to_mergekit(self) -> dict:
        """The same merge in mergekit's YAML schema."""
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
        config = {"merge_method": self.method, "models": models, "dtype": self.dtype}
        if self.method == "linear":
            config["parameters"] = {"normalize": settings["normalize"]}
            return config
        config["base_model"] = self.base
        config["parameters"] = {"lambda": settings["lam"], "normalize": settings["normalize"]}
        if "drop_rate" in settings:
            config["parameters"]["rescale"] = True  # L1 rescaling; mergekit's only DARE rescale
        return config


def load_merge_config(config) -> tuple[dict, CheckpointMergeConfig | None]:
    """(mergekit dict, our typed config or None) from a YAML path, a dict or a CheckpointMergeConfig.

    A dict (or YAML file) with `merge_method` is mergekit's schema and is passed on unchanged;
    one with `method` is ours.
    """
    if isinstance(config, CheckpointMergeConfig):
        return config.to_mergekit(), config
    if isinstance(config, (str, os.PathLike)):
        config = read_yaml_mapping(config, "merge config")
    if not isinstance(config, Mapping):
        raise ValueError(
            "`config` must be a YAML file, a dict in mergekit's schema (with `merge_method`) or ours "
            f"(with `method`), or a CheckpointMergeConfig; got {type(config).__name__}"
        )
    if "merge_method" in config:
        return dict(config), None
    if "method" in config:
        try:
            ours = CheckpointMergeConfig.model_validate(dict(config))
        except ValidationError as error:
            raise readable_error(error, CheckpointMergeConfig, "the merge config") from None
        return ours.to_mergekit(), ours
    raise ValueError(f"`config` has neither `merge_method` (mergekit) nor `method` (ours); keys: {sorted(config)}")


def merge_checkpoints(
    config,
    out_dir: str | os.PathLike,
    overwrite: bool = False,
    *,
    options: Mapping | None = None,
) -> Path:
    """Run mergekit's `run_merge` on local checkpoints and write the result atomically to `out_dir`.

    `config` is a mergekit YAML file, a dict in mergekit's schema, or our `CheckpointMergeConfig`
    (or its dict / YAML form), which is translated. `options` are mergekit `MergeOptions` fields
    (e.g. {"device": "cuda"}); by default the tokenizer is copied only if the base (or first)
    model folder has one, and our config's `seed` becomes `random_seed`.

    The merge runs into a temporary folder next to `out_dir`, which is renamed on success; a
    failure leaves nothing at `out_dir`. The output holds mergekit's files (config.json,
    model*.safetensors, mergekit_config.yml) and, for our config, `mergecompose_config.yaml`;
    it loads with `AutoModelForCausalLM.from_pretrained`.
    """
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    mergekit_dict, ours = load_merge_config(config)
    merge_configuration = MergeConfiguration.model_validate(mergekit_dict)
    for reference in merge_configuration.referenced_models():
        path = str(reference.model.path)
        # mergekit takes a missing local folder for a hub id; say what is wrong instead.
        if path.startswith(("/", "./", "../", "~")) and not Path(path).expanduser().is_dir():
            raise ValueError(f"model folder {path!r} in `config` does not exist")
    sources = [str(reference.model.path) for reference in merge_configuration.referenced_models()]
    config_file = [config] if isinstance(config, (str, os.PathLike)) else []
    refuse_output_over_inputs(out_dir, [*sources, *config_file])
    refuse_existing(out_dir, overwrite)
    defaults = {"copy_tokenizer": _has_tokenizer(mergekit_dict), "quiet": False}
    if ours is not None and ours.model_extra.get("seed") is not None:
        defaults["random_seed"] = ours.model_extra["seed"]
    merge_options = MergeOptions(**{**defaults, **dict(options or {})})
    with atomic_output_dir(out_dir, overwrite) as folder:
        run_merge(merge_configuration, str(folder), merge_options, config_source=yaml.safe_dump(mergekit_dict, sort_keys=False))
        if ours is not None:
            (folder / "mergecompose_config.yaml").write_text(yaml.safe_dump(ours.model_dump(), sort_keys=False))
    return Path(out_dir)


def _has_tokenizer(mergekit_dict: Mapping) -> bool:
    """Whether the model mergekit takes the tokenizer from has tokenizer files (hub ids: assume so)."""
    source = mergekit_dict.get("base_model") or next(
        (model["model"] for model in mergekit_dict.get("models") or [] if isinstance(model, Mapping)), None
    )
    if not isinstance(source, str) or not Path(source).is_dir():
        return True
    return any((Path(source) / name).exists() for name in _TOKENIZER_FILES)
