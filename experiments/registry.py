"""Task types of `mergecompose compare`, registered by name (`task: {type: NAME, ...}` in a config).

A task type is the pydantic model of a config's `task:` block. The generic pipeline
(`mergecompose.experiments.compare`) asks it for everything task-specific, through the `TaskType` protocol below;
nothing outside a task type's own folder branches on its name. A new task type is a new folder
that defines such a model and registers it:

    @register_task_type("letters")
    class LettersTaskSettings(BaseModel): ...

A duplicate name is an error; an unknown name lists the valid ones.

**Compare kinds.** Most task types are synthetic tasks that `mergecompose.experiments.compare` trains itself, all
configured by `mergecompose.experiments.config.CompareConfig`. A task type whose comparison is a different job
(`type: lm_eval`: given checkpoints, scored by lm-evaluation-harness) registers a *compare kind*
instead: its own top-level config model and the function that runs it. `mergecompose.experiments.config.load_config`
and `mergecompose.experiments.compare.run_compare` dispatch through `COMPARE_KINDS`:

    register_compare_kind("lm_eval", LmEvalCompareConfig, run_lm_eval_compare)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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


_REGISTRY: dict[str, type[BaseModel]] = {}
TASK_TYPES = MappingProxyType(_REGISTRY)


def register_task_type(name: str) -> Callable[[type[BaseModel]], type[BaseModel]]:
    """Class decorator: register a task type's settings model under `name` (a duplicate is an error)."""

    def add(cls: type[BaseModel]) -> type[BaseModel]:
        if name in _REGISTRY:
            raise ValueError(f"task type {name!r} is already registered (by {_REGISTRY[name].__qualname__})")
        if name in _COMPARE_KINDS:
            raise ValueError(f"task type {name!r} is already registered (as a compare kind)")
        missing = [
            member for member in _protocol_members() if not hasattr(cls, member) and member not in cls.model_fields
        ]
        if missing:
            raise TypeError(f"task type {name!r} ({cls.__qualname__}) lacks {missing} of the TaskType protocol")
        _REGISTRY[name] = cls
        return cls

    return add


def get_task_type(name: str) -> type[BaseModel]:
    """The settings model registered under `name`; an unknown name lists the valid ones."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown task type {name!r}; valid: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


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


@dataclass(frozen=True)
class CompareKind:
    """A comparison with its own config model: `run(config, out_dir, overwrite=, progress=, echo=) -> results`, and
    `preflight(config, out_dir, overwrite, config_path)`, which checks before any work what the run needs to its
    last step, loading no model and writing nothing (`mergecompose compare --check`)."""

    task_type: str
    config: type[BaseModel]
    run: Callable[..., dict]
    preflight: Callable[..., None] | None = None


_COMPARE_KINDS: dict[str, CompareKind] = {}
COMPARE_KINDS = MappingProxyType(_COMPARE_KINDS)


def register_compare_kind(
    task_type: str, config: type[BaseModel], run: Callable[..., dict], preflight: Callable[..., None] | None = None
) -> None:
    """Configs whose `task.type` is `task_type` are `config` models, run by `run` after `preflight` (a duplicate is
    an error)."""
    if task_type in _COMPARE_KINDS or task_type in _REGISTRY:
        raise ValueError(f"task type {task_type!r} is already registered")
    _COMPARE_KINDS[task_type] = CompareKind(task_type, config, run, preflight)


def compare_kind_of(config: BaseModel) -> CompareKind | None:
    """The compare kind whose config model `config` is, or None (a synthetic-task `CompareConfig`)."""
    return next((kind for kind in _COMPARE_KINDS.values() if isinstance(config, kind.config)), None)
