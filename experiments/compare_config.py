"""Typed configuration of a `mergecompose compare` run, loaded from YAML (`load_config`).

A run trains a base and its experts, builds the merges and the compositions, and evaluates
every system on the same held-out data. Every field is checked at load time; an unknown key is
an error that names it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SerializeAsAny,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from mergecompose.composition.remedies import RemedySettings
from mergecompose.core.import_paths import is_import_path, source_hash
from mergecompose.core.io import StrictModel, read_yaml_mapping, validation_message
from mergecompose.core.training import OptimizerSettings
from mergecompose.experiments.plugins import compare_kinds, missing_extra, validate_task
from mergecompose.merging import METHODS, validate_merge_params

DEFAULT_TASK_TYPE = "letters"


# The linear layers LoRA may adapt in each architecture (peft matches `target_modules` by name suffix).
LORA_TARGETS = {
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "gpt2": ("c_attn", "c_proj", "c_fc"),
}


class PositionSettings(StrictModel):
    """Position ids (see `mergecompose.experiments.formats`): the scheme, and random slots in training."""

    scheme: Literal["coupled", "contiguous"] = "coupled"
    randomize: bool = True
    max_position: int = Field(256, ge=1)


class ModelSettings(StrictModel):
    """A small transformers causal LM: Llama (RoPE) or GPT-2 (learned absolute positions)."""

    architecture: Literal["llama", "gpt2"] = "llama"
    hidden_size: int = Field(64, ge=1)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(2, ge=1)
    intermediate_size: int | None = Field(None, ge=1)  # default: 2 × hidden (llama), 4 × hidden (gpt2)
    max_position_embeddings: int = Field(256, ge=1)
    rope_theta: float = Field(10000.0, gt=0)

    @model_validator(mode="after")
    def _heads(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"`hidden_size` ({self.hidden_size}) must be divisible by `num_heads` ({self.num_heads})")
        return self


class TrainingSettings(OptimizerSettings):
    """One training run: either `steps` on fresh random strings, or `epochs` over `num_examples` fixed ones.

    The optimizer's fields (`lr`, `weight_decay`, `schedule`, `warmup_fraction`, `grad_clip`) are
    `mergecompose.core.training.OptimizerSettings`'s, for the one trainer (`mergecompose.core.training.train_model`).
    """

    steps: int | None = Field(None, ge=1)
    epochs: int | None = Field(None, ge=1)
    num_examples: int | None = Field(None, ge=1)
    batch_size: int = Field(64, ge=1)

    @model_validator(mode="after")
    def _one_budget(self):
        streaming = self.steps is not None
        fixed = self.epochs is not None or self.num_examples is not None
        if streaming == fixed or (fixed and (self.epochs is None or self.num_examples is None)):
            raise ValueError(
                "give either `steps` (fresh random strings every step) or both `epochs` and `num_examples` "
                f"(a fixed training set), got steps={self.steps}, epochs={self.epochs}, "
                f"num_examples={self.num_examples}"
            )
        return self

    @property
    def total_steps(self) -> int:
        if self.steps is not None:
            return self.steps
        return self.epochs * -(-self.num_examples // self.batch_size)


class LoraSettings(StrictModel):
    """A peft LoRA adapter trained on the base (which stays frozen)."""

    rank: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    training: TrainingSettings


class ExpertTraining(StrictModel):
    """How experts are made: fine-tuned from the base (full and LoRA), or trained from scratch (the paper)."""

    init: Literal["base", "scratch"] = "base"
    full: TrainingSettings
    lora: LoraSettings | None = None
    # Skill name -> LoRA settings that replace `lora` for that skill's adapter only (a skill the
    # adapter needs a larger budget for). Left out of dumps when empty, so hashes stay as they were;
    # the other adapters' recipes, and so their cached checkpoints, are unchanged.
    lora_per_skill: dict[str, LoraSettings] = Field(default_factory=dict, exclude_if=lambda value: not value)

    @model_validator(mode="after")
    def _lora_needs_base(self):
        if self.init == "scratch" and self.lora is not None:
            raise ValueError("`lora` needs experts fine-tuned from the base (`init: base`); got `init: scratch`")
        if self.lora_per_skill and self.lora is None:
            raise ValueError(
                f"`lora_per_skill` (for {sorted(self.lora_per_skill)}) overrides `lora`, which is not set; "
                "set `lora` too, or drop `lora_per_skill`"
            )
        return self

    def lora_for(self, skill: str) -> LoraSettings | None:
        """The LoRA settings of `skill`'s adapter: its `lora_per_skill` entry, else `lora`."""
        return self.lora_per_skill.get(skill, self.lora)


class TrainingPlan(StrictModel):
    seed: int = Field(0, ge=0)
    base: TrainingSettings
    experts: ExpertTraining


class EvaluationSettings(StrictModel):
    """Held-out data. Main splits use strings of `length`; `lengths` are the per-length curves."""

    seed: int = Field(1234, ge=0)  # numpy's default_rng takes no negative seed
    length: int | None = Field(None, ge=1)  # default: the longest training length
    joint_size: int = Field(1000, ge=1)
    split_size: int = Field(500, ge=1)  # each single-skill split and `neither`
    validation_size: int = Field(200, ge=1)  # per main split, for choosing merge hyperparameters
    lengths: list[int] = Field(default_factory=lambda: [8, 16, 24, 32, 48, 64])
    length_size: int = Field(300, ge=1)
    batch_size: int = Field(256, ge=1)
    greedy_check: int = Field(32, ge=0)  # examples per system and length split decoded greedily

    @field_validator("lengths")
    @classmethod
    def _sorted_lengths(cls, value):
        if len(value) == 0 or any(length < 1 for length in value) or len(set(value)) != len(value):
            raise ValueError(f"`lengths` must be distinct positive integers, got {value}")
        return sorted(value)


class MergeGrid(StrictModel):
    """Candidate hyperparameters of one merge method; every combination is tried on validation.

    A built-in method's grid takes `lam`, `density` and `drop_rate`. A user's method, named by its import path
    (`package.module:Name`), may also list values of its own parameters (any other key, a list each): its
    settings model validates every grid point in `check_merge_grids`, before any training.
    """

    # Extra keys are a user method's own parameters; `check_merge_grids` refuses them for a built-in.
    model_config = ConfigDict(extra="allow")

    lam: list[float] | None = None
    density: list[float] | None = None
    drop_rate: list[float] | None = None

    @model_validator(mode="after")
    def _own_parameters_are_lists(self):
        for name, values in (self.model_extra or {}).items():
            if not isinstance(values, list):
                raise ValueError(f"`{name}` must list the values to try, got {values!r}")
        return self

    def candidates(self) -> list[dict[str, float]]:
        grid = [{}]
        for name in ("lam", "density", "drop_rate", *(self.model_extra or {})):
            values = getattr(self, name)
            if values is not None:
                if len(values) == 0:
                    raise ValueError(f"`{name}` must list at least one value, got []")
                grid = [{**point, name: value} for point in grid for value in values]
        return grid


def check_merge_grids(grids: dict[str, MergeGrid]) -> dict[str, MergeGrid]:
    """Every method is in `mergecompose.merging.METHODS` or a user's import path (`package.module:Name`, imported
    here), and every grid point is valid for it (before any training)."""
    unknown = sorted(method for method in grids if method not in METHODS and not is_import_path(method))
    if unknown:
        raise ValueError(
            f"unknown merge methods {unknown}; valid: {sorted(METHODS)}, or your own as `package.module:Name`"
        )
    for method, grid in grids.items():
        if not is_import_path(method) and grid.model_extra:
            raise ValueError(
                f"`merges.{method}`: {sorted(grid.model_extra)} are not grid keys of a built-in method; valid: lam, "
                "density, drop_rate (a method of your own, named by import path, may list its own parameters)"
            )
        for params in grid.candidates():
            try:
                validate_merge_params(method, params)
            except ValueError as error:
                raise ValueError(f"`merges.{method}`: {error}") from None
    return grids


def check_some_merge_grids(grids: dict[str, MergeGrid]) -> dict[str, MergeGrid]:
    """`check_merge_grids`, and at least one method (a sweep that picks the best merge needs one)."""
    if not grids:
        raise ValueError(f"`merges` must name at least one method; valid: {sorted(METHODS)}")
    return check_merge_grids(grids)


def _default_merges() -> dict[str, MergeGrid]:
    lams = [0.5, 0.75, 1.0, 1.25, 1.5]
    return {
        "linear": MergeGrid(),
        "task_arithmetic": MergeGrid(lam=lams),
        "ties": MergeGrid(lam=lams, density=[0.2, 0.5, 0.8]),
        "dare_ties": MergeGrid(lam=lams, drop_rate=[0.2, 0.5, 0.8]),
    }


class CompareConfig(StrictModel):
    """Everything `mergecompose compare` needs; the resolved config is written beside the results."""

    name: str = "letters"
    # The model registered for `task.type` (`mergecompose.experiments.plugins`); letters when no type is given.
    task: SerializeAsAny[BaseModel] = Field(default_factory=lambda: validate_task({}, DEFAULT_TASK_TYPE))
    positions: PositionSettings = Field(default_factory=PositionSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    training: TrainingPlan
    evaluation: EvaluationSettings = Field(default_factory=EvaluationSettings)
    merges: dict[str, MergeGrid] = Field(default_factory=_default_merges)
    seed_merges: int = Field(0, ge=0)  # DARE's random drop seed
    # Named remedy sets, each evaluated as one more system `compose+<name>` (`mergecompose.experiments.scored_systems`).
    # Left out of dumps when empty, so configs without remedies keep their hashes.
    remedies: dict[str, RemedySettings] = Field(default_factory=dict, exclude_if=lambda value: not value)
    # Other settings of the same comparison, each evaluated beside this one: variant name ->
    # overrides merged (recursively) into this config. Their systems are added to the results as
    # `<variant>/<system>`; e.g. contiguous positions, where merging and composing differ.
    # Left out of dumps when empty, so configs without variants keep their hashes.
    variants: dict[str, dict] = Field(default_factory=dict, exclude_if=lambda value: not value)

    @field_validator("task", mode="before")
    @classmethod
    def _task(cls, value):
        return validate_task(value, DEFAULT_TASK_TYPE)

    @field_validator("merges")
    @classmethod
    def _known_methods(cls, value):
        return check_merge_grids(value)

    @model_validator(mode="after")
    def _consistent(self):
        if self.task.formulation == "aligned" and self.positions.scheme == "coupled":
            raise ValueError("`positions.scheme: coupled` is for seq2seq; the aligned formulation needs `contiguous`")
        self.task.check_config(self)
        lengths = {
            "evaluation.lengths": max(self.evaluation.lengths),
            "evaluation.length": self.eval_length,
            "task.train_lengths": self.task.train_lengths[1],
        }
        longest = max(lengths.values())
        source = next(name for name, length in lengths.items() if length == longest)
        # seq2seq: room for the tokens greedy decoding may generate past the target (the task's margin).
        needed = self.slots_needed(longest) + (
            self.task.generation_margin() if self.task.formulation == "seq2seq" else 0
        )
        if needed > self.positions.max_position:
            raise ValueError(
                f"`positions.max_position` = {self.positions.max_position} is too small for strings of length "
                f"{longest}, from `{source}` (needs {needed} with `task.formulation` {self.task.formulation!r})"
            )
        if self.positions.max_position > self.model.max_position_embeddings:
            raise ValueError(
                f"`positions.max_position` ({self.positions.max_position}) exceeds "
                f"`model.max_position_embeddings` ({self.model.max_position_embeddings})"
            )
        experts = self.training.experts
        for where, lora in [
            ("lora", experts.lora),
            *((f"lora_per_skill.{k}", v) for k, v in experts.lora_per_skill.items()),
        ]:
            targets = LORA_TARGETS[self.model.architecture]
            if lora is not None and lora.target_modules != "all-linear":
                wrong = [name for name in lora.target_modules if name.rsplit(".", 1)[-1] not in targets]
                if wrong:
                    raise ValueError(
                        f"`training.experts.{where}.target_modules` names {wrong}, which are not linear layers of "
                        f"{self.model.architecture}; valid: {list(targets)} or 'all-linear'"
                    )
        known = self.task.skill_names()
        unknown = sorted(set(self.training.experts.lora_per_skill) - set(known))
        if unknown:
            raise ValueError(f"`training.experts.lora_per_skill` names unknown skills {unknown}; valid: {known}")
        if self.training.experts.init == "scratch" and self.merges:
            raise ValueError(
                "merges need experts fine-tuned from the base (`training.experts.init: base`); "
                "with `init: scratch` set `merges: {}`"
            )
        return self

    @model_validator(mode="after")
    def _valid_variants(self):
        self.variant_configs()  # every variant is validated with the config, before any training
        return self

    def variant_configs(self) -> dict[str, CompareConfig]:
        """Each variant as a full config: this one's settings with the variant's overrides merged in."""
        resolved = {}
        for name, overrides in self.variants.items():
            if not name.isidentifier():
                raise ValueError(f"variant names must be identifiers (they prefix system names), got {name!r}")
            if "variants" in overrides or "name" in overrides:
                raise ValueError(f"`variants.{name}` may not set `variants` or `name`, got keys {sorted(overrides)}")
            data = deep_merge(self.model_dump(mode="json", exclude={"variants"}), overrides)
            data["name"] = f"{self.name}/{name}"
            try:
                resolved[name] = CompareConfig.model_validate(data)
            except ValidationError as error:
                raise ValueError(f"`variants.{name}`: {validation_message(error)}") from None
        return resolved

    @property
    def eval_length(self) -> int:
        return self.evaluation.length or self.task.train_lengths[1]

    def slots_needed(self, length: int) -> int:
        if self.task.formulation == "aligned":
            return length
        if self.positions.scheme == "coupled":
            return length + 1
        return length + 2 + self.task.max_target_length(length)


def deep_merge(base: dict, overrides: dict) -> dict:
    """`base` with `overrides` merged in: nested mappings are merged key by key, other values replaced."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(path: str | Path) -> BaseModel:
    """Read a compare config once (`yaml.safe_load`) and validate it once (`validate_compare_config`); errors name
    the file and the field. Relative paths in it are read from the file's folder."""
    return validate_compare_config(read_yaml_mapping(path), path)


def validate_compare_config(data: dict, path: str | Path | None = None) -> BaseModel:
    """`data` validated as one union of the compare configs, keyed on `task.type`: a compare kind's own model
    (`mergecompose.experiments.plugins.compare_kinds`, e.g. `lm_eval`), else `CompareConfig` (the synthetic
    tasks, whose `task` block is validated by its task type's model)."""
    where = f"{path}: " if path is not None else ""
    task_type = _type_of(data)
    extra = missing_extra(task_type) if isinstance(task_type, str) else None
    if extra is not None:
        raise ValueError(
            f"{where}`task.type: {task_type}` needs the {extra} extra, which is not installed: "
            f'pip install "mergecompose[{extra}]"'
        )
    if _tag(data) == _SYNTHETIC:
        _check_no_other_kind(where, data)
    context = {"config_dir": Path(path).parent} if path is not None else None
    try:
        return _union().validate_python(data, context=context)
    except ValidationError as error:
        raise ValueError(f"{where}invalid config: {validation_message(error, tagged=True)}") from None


_SYNTHETIC = "synthetic"


def _type_of(data: dict) -> object:
    task = data.get("task")
    return task.get("type") if isinstance(task, dict) else None


def _tag(value: object) -> str:
    """The union's key: the compare kind named by `task.type` (of a mapping, or of a config model), else synthetic."""
    kinds = compare_kinds()
    if isinstance(value, dict):
        task_type = _type_of(value)
        return task_type if isinstance(task_type, str) and task_type in kinds else _SYNTHETIC
    return next((name for name, kind in kinds.items() if isinstance(value, kind.config)), _SYNTHETIC)


def _union() -> TypeAdapter:
    """The compare configs as one pydantic union keyed on `task.type` (built for the kinds registered now)."""
    kinds = compare_kinds()
    key = tuple((name, kind.config) for name, kind in sorted(kinds.items()))
    if key not in _UNIONS:
        members = tuple(Annotated[model, Tag(name)] for name, model in key)
        union = Union[(Annotated[CompareConfig, Tag(_SYNTHETIC)], *members)]  # noqa: UP007 - built at run time
        _UNIONS[key] = TypeAdapter(Annotated[union, Discriminator(_tag)])
    return _UNIONS[key]


_UNIONS: dict[tuple, TypeAdapter] = {}


def _check_no_other_kind(where: str, data: dict) -> None:
    """Refuse a config read as a synthetic comparison (no `task.type` of a compare kind) whose keys belong to a
    compare kind's config: its `task.type` was left out or misspelt, and that is what to say."""
    own = set(CompareConfig.model_fields)
    for task_type, kind in compare_kinds().items():
        theirs = sorted(set(data) & (set(kind.config.model_fields) - own))
        if theirs:
            raise ValueError(
                f"{where}`task.type` is {_task_type(data)}, so this is read as a synthetic-task config, but its keys "
                f"{theirs} are those of a `task: {{type: {task_type}}}` config; set `task.type`"
            )


def _task_type(data: dict) -> str:
    task = data.get("task")
    if not isinstance(task, dict):
        return "missing (no `task` mapping)"
    return "missing" if "type" not in task else repr(task["type"])


def user_code_hashes(config: CompareConfig) -> dict[str, str | None]:
    """SHA-256 of the module of each user merge method the config (or a variant) names by import path."""
    merges = [config.merges, *(variant.merges for variant in config.variant_configs().values())]
    return {method: source_hash(method) for grids in merges for method in grids if is_import_path(method)}


def config_fingerprint(config: CompareConfig) -> str:
    """`fingerprint(config)`, with the source hashes of the user's merge methods where it names any, so that a
    changed method recomputes what the cache holds (a config without them keeps its hash)."""
    hashes = user_code_hashes(config)
    return fingerprint(config, {"user_code": hashes}) if hashes else fingerprint(config)


def fingerprint(*parts) -> str:
    """A short, stable hash of JSON-able parts (pydantic models are dumped first)."""
    dumped = [part.model_dump(mode="json") if isinstance(part, BaseModel) else part for part in parts]
    text = json.dumps(dumped, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]
