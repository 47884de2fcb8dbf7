"""Task types and compare kinds of `mergecompose compare`, registered in one place: the entry points in
`pyproject.toml`. The pipeline imports none of them; each is imported when a config first asks for its name.

    [project.entry-points."mergecompose.task_types"]       # a config's `task:` block: name -> settings model
    letters = "mergecompose.studies.letters.letters_task_type:LettersTaskSettings"

    [project.entry-points."mergecompose.compare_kinds"]    # a comparison with its own config: name -> CompareKind
    lm_eval = "mergecompose.experiments.lm_eval.lm_eval_compare:LM_EVAL_KIND"

A task type is the pydantic model of a config's `task:` block. The generic pipeline
(`mergecompose.experiments.compare`) asks it for everything task-specific, through the `TaskType` protocol below;
nothing outside a task type's own folder branches on its name. A compare kind (`type: lm_eval`: given
checkpoints, scored by lm-evaluation-harness) is a different job: its own top-level config model, its pre-flight
and the function that runs it (`CompareKind`). `compare_config.load_config` validates a config as
one union of these models, keyed on `task.type`.

A duplicate name is an error; an unknown name lists the valid ones. `register_task_type` and
`register_compare_kind` add one at run time (a plug-in of a program that embeds the pipeline, or a test).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel


@runtime_checkable
class TaskType(Protocol):
    """What the compare pipeline asks of a config's `task:` block."""

    type: str
    formulation: str  # "seq2seq" or "aligned" (see `mergecompose.experiments.formats`)
    alphabet: str  # the characters of the tokenizer
    train_lengths: tuple[int, int]
    joint: list[str]  # the skills composed (and merged) for the joint task

    def title(self) -> str:
        """What the task is, for report titles ("letter replacement")."""

    def trained_skills(self) -> list[str]:
        """The skills an expert is trained for."""

    def skill_names(self) -> list[str]:
        """Every skill the task defines (trained or not)."""

    def check_config(self, config) -> None:
        """Raise ValueError if the rest of the compare config does not fit this task (lengths, positions)."""

    def data_recipe(self) -> dict | None:
        """What shapes every checkpoint's training data beyond the alphabet and lengths (for its hash)."""

    def skill_recipe(self, name: str) -> dict:
        """What shapes expert `name`'s training data (for its hash)."""

    def training_strings(self, skill: str | None, tokenizer, sequence_format, settings, seed: int):
        """An iterable of training `Batch`es for the base (`skill=None`) or one expert."""

    def eval_data(self, settings, main_length: int, train_max: int):
        """The `mergecompose.experiments.evaluate.EvalData`: test and validation splits, and the per-length curves."""

    def expert_variant(self, base, expert, name: str):
        """The expert the systems use (as trained, or a variant of it)."""

    def sections(self) -> dict[str, Callable]:
        """Results sections this task adds: name -> function of the run context."""

    def plots(self, results: dict, out_dir) -> list[str]:
        """Write task-specific plots into `out_dir`; return their file names."""

    def max_target_length(self, length: int) -> int:
        """The longest target of an input of `length` characters."""

    def generation_margin(self) -> int:
        """Tokens greedy decoding may generate past a target."""


TASK_TYPE_GROUP = "mergecompose.task_types"
COMPARE_KIND_GROUP = "mergecompose.compare_kinds"
# Compare kinds whose module needs an optional extra: task type -> the extra that installs what it imports.
OPTIONAL_COMPARE_KINDS = {"lm_eval": "lm-eval", "math_code": "real-model"}


@dataclass(frozen=True)
class CompareKind:
    """A comparison with its own config model. `preflight(config, out_dir, overwrite, config_path)` checks before
    any work what the run needs to its last step, loading no model and writing nothing (`mergecompose compare
    --check`); `run(config, out_dir, overwrite=, progress=, echo=) -> results` runs it, its pre-flight passed."""

    task_type: str
    config: type[BaseModel]
    run: Callable[..., dict]
    preflight: Callable[..., None] | None = None


class _Registry:
    """The task types and compare kinds: the entry points, loaded once on first use, and those registered since."""

    def __init__(self) -> None:
        self.task_types: dict[str, type[BaseModel]] = {}
        self.compare_kinds: dict[str, CompareKind] = {}
        self.missing_extras: dict[str, str] = {}  # compare kind -> the extra its module needs, not installed
        self.loaded = False

    def load(self) -> None:
        if self.loaded:
            return
        self.loaded = True
        for entry in entry_points(group=TASK_TYPE_GROUP):
            self.add_task_type(entry.name, entry.load())
        for entry in entry_points(group=COMPARE_KIND_GROUP):
            try:
                kind = entry.load()
            except ModuleNotFoundError:
                if entry.name not in OPTIONAL_COMPARE_KINDS:
                    raise
                self.missing_extras[entry.name] = OPTIONAL_COMPARE_KINDS[entry.name]
                continue
            self.add_compare_kind(entry.name, kind)

    def add_task_type(self, name: str, cls: type[BaseModel]) -> None:
        if name in self.task_types:
            raise ValueError(f"task type {name!r} is already registered (by {self.task_types[name].__qualname__})")
        if name in self.compare_kinds:
            raise ValueError(f"task type {name!r} is already registered (as a compare kind)")
        missing = [
            member for member in _protocol_members() if not hasattr(cls, member) and member not in cls.model_fields
        ]
        if missing:
            raise TypeError(f"task type {name!r} ({cls.__qualname__}) lacks {missing} of the TaskType protocol")
        self.task_types[name] = cls

    def add_compare_kind(self, name: str, kind: CompareKind) -> None:
        if not isinstance(kind, CompareKind) or kind.task_type != name:
            raise TypeError(f"compare kind {name!r} must be a CompareKind for task type {name!r}, got {kind!r}")
        if name in self.compare_kinds or name in self.task_types:
            raise ValueError(f"task type {name!r} is already registered")
        self.compare_kinds[name] = kind


_REGISTRY = _Registry()


def task_types() -> Mapping[str, type[BaseModel]]:
    """Every task type: name -> its settings model (read-only)."""
    _REGISTRY.load()
    return MappingProxyType(_REGISTRY.task_types)


def compare_kinds() -> Mapping[str, CompareKind]:
    """Every compare kind whose extra is installed: task type -> its `CompareKind` (read-only)."""
    _REGISTRY.load()
    return MappingProxyType(_REGISTRY.compare_kinds)


def missing_extra(task_type: str) -> str | None:
    """The extra to install for a compare kind whose module could not be imported, else None."""
    _REGISTRY.load()
    return _REGISTRY.missing_extras.get(task_type)


def register_task_type(name: str) -> Callable[[type[BaseModel]], type[BaseModel]]:
    """Class decorator: register a task type's settings model under `name` at run time (a duplicate is an
    error). The project's own task types are entry points (`pyproject.toml`)."""

    def add(cls: type[BaseModel]) -> type[BaseModel]:
        _REGISTRY.load()
        _REGISTRY.add_task_type(name, cls)
        return cls

    return add


def register_compare_kind(
    task_type: str, config: type[BaseModel], run: Callable[..., dict], preflight: Callable[..., None] | None = None
) -> None:
    """Configs whose `task.type` is `task_type` are `config` models, run by `run` after `preflight`, from now on (a
    duplicate is an error). The project's own compare kinds are entry points (`pyproject.toml`)."""
    _REGISTRY.load()
    _REGISTRY.add_compare_kind(task_type, CompareKind(task_type, config, run, preflight))


def get_task_type(name: str) -> type[BaseModel]:
    """The settings model registered under `name`; an unknown name lists the valid ones."""
    types = task_types()
    if not isinstance(name, str) or name not in types:
        raise ValueError(f"unknown task type {name!r}; valid: {sorted(types)}")
    return types[name]


def validate_task(value: Any, default: str) -> BaseModel:
    """A `task:` block (dict or model) validated by the model of its `type` (`default` when absent)."""
    if isinstance(value, BaseModel):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"`task` must be a mapping of settings, got {type(value).__name__}")
    return get_task_type(value.get("type", default)).model_validate(value)


def _protocol_members() -> list[str]:
    methods = [name for name, value in vars(TaskType).items() if callable(value) and not name.startswith("_")]
    return [*TaskType.__annotations__, *methods]


def compare_kind_of(config: BaseModel) -> CompareKind | None:
    """The compare kind whose config model `config` is, or None (a synthetic-task `CompareConfig`)."""
    return next((kind for kind in compare_kinds().values() if isinstance(config, kind.config)), None)
