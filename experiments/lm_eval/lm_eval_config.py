"""The typed config of a `type: lm_eval` compare: given checkpoints, every merge and composition, lm-eval's tasks.

    name: gemma2_mergebench
    task:                                 # the lm-eval tasks and how lm-eval runs them
      type: lm_eval
      names: [gsm8k_cot, minerva_math, humaneval_plus, mbpp_plus]
      include_path: null                  # a folder of your own task YAMLs (lm-eval's include_path)
      limit: null                         # examples per task (null: all)
      num_fewshot: null                   # null: each task's own
      gen_kwargs: {do_sample: false}      # overrides of the tasks' generation settings
    base: google/gemma-2-2b               # a checkpoint folder or hub id
    experts:                              # name -> full checkpoint or peft adapter (folder or hub id)
      math: MergeBench/gemma-2-2b_math
      coding: MergeBench/gemma-2-2b_coding
    compositions:                         # system name -> experts composed, weights, remedies
      compose: {experts: [math, coding]}
    merges:                               # method (mergecompose.merging.METHODS, run by mergekit) -> grid
      task_arithmetic: {lam: [0.5, 1.0]}
    merge_experts: null                   # the experts merged (null: all)
    merge_selection: {task: gsm8k_cot, split: train, limit: 100}   # where grids with > 1 point are chosen
    batch_size: 8
    device: cuda
    dtype: bfloat16
    allow_code_execution: false           # code tasks (humaneval, mbpp) run model-written code

Systems: `base`, `expert:<name>`, each composition under its own name, `merge:<method>`.
Everything is checked at load time, before any model loads: every field and grid point (with
mergekit's definitions, as `merge_checkpoints` will run it), that local folders exist and are
checkpoints or adapters, that lm-eval knows every task, and that no code task runs without
`allow_code_execution: true` (lm-eval's `confirm_run_unsafe_code`).

Relative paths in the config (`task.include_path`, `native_run.folder`, local `base` and `experts`) are read
from the config file's own folder (pydantic's validation context `config_dir`, which
`mergecompose.core.io.load_yaml_config` gives), and from the working directory for a config validated
from a dict; they are stored absolute, so the resolved config beside the results loads from anywhere.
A hub id stays a hub id. What needs a task, a model or a device is checked before any work by
`mergecompose.experiments.lm_eval.preflight.check_before_work`.

`native_run` takes the systems from a native seq2seq compare run instead (see
`mergecompose.experiments.lm_eval.native_run.NativeRun`): fields left out are filled in from that run.
`letters_run`, its former name, is read as `native_run` with a FutureWarning (shown on the command line
too), for one release.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from mergecompose.composition.remedies import RemedySettings
from mergecompose.core import sources
from mergecompose.core.executor import Resources, ResourcesConfig
from mergecompose.core.import_paths import is_import_path
from mergecompose.core.io import StrictModel
from mergecompose.core.sources import check_hub_id, check_model_source, hub_offline, is_local
from mergecompose.experiments.compare_config import MergeGrid, check_merge_grids
from mergecompose.experiments.lm_eval.catalog import check_task_files, check_task_names, task_kind, unsafe_tasks
from mergecompose.experiments.lm_eval.native_run import NativeRun
from mergecompose.merging import METHODS, CheckpointMergeConfig

_DEVICE = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")
RESERVED_PREFIXES = ("expert:", "merge:")


class LmEvalTaskSettings(StrictModel):
    """The `task:` block: lm-eval's task names (tasks, groups or tags) and how lm-eval runs them."""

    type: Literal["lm_eval"]
    names: list[str] = Field(default_factory=list)
    include_path: str | None = None
    limit: int | None = Field(None, ge=1)
    num_fewshot: int | None = Field(None, ge=0)
    gen_kwargs: dict[str, str | int | float | bool] | None = None

    @field_validator("names")
    @classmethod
    def _distinct(cls, value):
        if len(set(value)) != len(value) or any(not name for name in value):
            raise ValueError(f"`names` must be distinct, non-empty lm-eval task names, got {value}")
        return value

    @field_validator("include_path")
    @classmethod
    def _folder(cls, value):
        if value is not None and not Path(value).expanduser().is_dir():
            raise ValueError(
                f"`include_path` must be a folder of lm-eval task YAMLs, got {value!r}, which is not a folder"
            )
        return value


class CompositionSettings(StrictModel):
    """One composition: `ComposedLM` of these experts (by name), with optional weights and remedies."""

    experts: list[str] = Field(min_length=1)
    weights: list[float] | None = None
    remedies: RemedySettings | None = None

    @model_validator(mode="after")
    def _weights(self):
        if len(set(self.experts)) != len(self.experts):
            raise ValueError(f"`experts` must be distinct, got {self.experts}")
        if self.weights is not None and len(self.weights) != len(self.experts):
            raise ValueError(f"`weights` must hold one weight per expert ({len(self.experts)}), got {self.weights}")
        return self


class MergeSelection(StrictModel):
    """Where a merge grid with more than one point is chosen: an lm-eval task, optionally another split of it."""

    task: str
    split: str | None = None  # e.g. "train" or "validation": the task's test split is replaced by it
    limit: int | None = Field(None, ge=1)
    metric: str | None = None  # "exact_match" or lm-eval's "exact_match,strict-match"; default: the first


class LmEvalCompareConfig(StrictModel):
    """Everything a `type: lm_eval` compare needs; the resolved config is written beside the results."""

    name: str = "lm_eval"
    task: LmEvalTaskSettings
    base: str
    experts: dict[str, str] = Field(default_factory=dict)
    compositions: dict[str, CompositionSettings] = Field(default_factory=dict)
    merges: dict[str, MergeGrid] = Field(default_factory=dict)
    merge_experts: list[str] | None = None  # default: every expert
    merge_selection: MergeSelection | None = None
    seed_merges: int = Field(0, ge=0)  # DARE's random drop seed (mergekit's random_seed)
    # Whose definitions the merges follow: mergekit's (`merge_checkpoints` on disk, the default), or
    # the papers' (`mergecompose.merging.merge` in memory, as `mergecompose compare` merges, then saved): TIES and
    # DARE differ between the two (see README, Merging).
    merge_definitions: Literal["mergekit", "paper"] = "mergekit"
    native_run: NativeRun | None = None
    batch_size: int = Field(8, ge=1)
    device: str = "cpu"
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    allow_code_execution: bool = False
    # What each cell asks of a Ray node (`--executor ray`); not part of the config's fingerprint.
    resources: ResourcesConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_native_run(cls, data, info: ValidationInfo):
        """Relative paths read from the config's folder; then fields left out are taken from `native_run` (its
        base, experts, composition and chosen merges)."""
        if not isinstance(data, dict):
            return data
        if "letters_run" in data and "native_run" not in data:
            warnings.warn(
                "the lm_eval config's `letters_run` is now `native_run`; `letters_run` will be removed",
                FutureWarning,
                stacklevel=2,
            )
            data = {("native_run" if key == "letters_run" else key): value for key, value in data.items()}
        data = resolve_paths(data, Path((info.context or {}).get("config_dir") or "."))
        if isinstance(data.get("native_run"), dict | NativeRun):
            run = NativeRun.model_validate(data["native_run"])
            data = {**run.system_fields(), **data}
        elif "base" not in data:
            raise ValueError("give the systems: `base` and `experts`, or `native_run` to take them from a native run")
        return data

    @field_validator("device")
    @classmethod
    def _device(cls, value):
        if not _DEVICE.match(value):
            raise ValueError(f"`device` must be 'cpu', 'cuda', 'cuda:N' or 'mps', got {value!r}")
        return value

    @field_validator("base")
    @classmethod
    def _base(cls, value):
        if not is_local(value):  # a hub id: its form now, whether it loads when the run starts (`check_hub_sources`)
            check_hub_id(value, "base")
            return value
        return _check_base(value)

    @field_validator("experts")
    @classmethod
    def _experts(cls, value):
        for name, source in value.items():
            check_expert_name(name)
            source_kind(source, f"experts.{name}")
        return value

    @field_validator("merges")
    @classmethod
    def _merges(cls, value):
        check_merge_grids(value)
        # A user's method (an import path) is merged in memory; the built-ins are written by mergekit.
        offline = sorted(method for method in value if not is_import_path(method) and not METHODS[method].mergekit)
        if offline:
            raise ValueError(
                f"merges are written by mergekit, which does not run {offline}; use one of "
                f"{sorted(name for name, method in METHODS.items() if method.mergekit)}"
            )
        return value

    @model_validator(mode="after")
    def _consistent(self):
        for name, composition in self.compositions.items():
            check_composition_name(name)
            self._known_experts(composition.experts, f"compositions.{name}.experts")
        if self.merges:
            merged = self.merged_experts()
            self._known_experts(merged, "merge_experts")
            for method, grid in self.merges.items():
                if is_import_path(method):  # merged in memory; each grid point was validated by its settings model
                    continue
                for params in grid.candidates():  # with mergekit's definitions, as merge_checkpoints runs it
                    self.merge_config(method, params, {name: self.experts[name] for name in merged})
            if self.merge_selection is None and any(len(grid.candidates()) > 1 for grid in self.merges.values()):
                raise ValueError(
                    "a merge grid with more than one point needs `merge_selection` (the lm-eval task it is chosen on)"
                )
        if not self.task.names and self.native_run is None:
            raise ValueError("`task.names` must name at least one lm-eval task (or give `native_run`)")
        self.check_tasks()
        return self

    def _known_experts(self, names: list[str], where: str) -> None:
        unknown = [name for name in names if name not in self.experts]
        if unknown or not names:
            raise ValueError(f"`{where}` must name experts of `experts` ({sorted(self.experts)}), got {names}")

    def merged_experts(self) -> list[str]:
        return list(self.experts) if self.merge_experts is None else list(self.merge_experts)

    def merge_config(self, method: str, params: dict, experts: dict[str, str]) -> CheckpointMergeConfig:
        """The mergekit merge of `experts` (name -> full checkpoint folder) at one grid point."""
        seed = {"seed": self.seed_merges} if "drop_rate" in params else {}
        return CheckpointMergeConfig.model_validate(
            {
                "method": method,
                "base": self.base,
                "experts": list(experts.values()),
                "dtype": self.dtype,
                **params,
                **seed,
            }
        )

    def include_paths(self) -> list[str]:
        return [] if self.task.include_path is None else [self.task.include_path]

    def cell_resources(self, kind: Literal["train", "cell"]) -> Resources:
        """What a cell of this kind asks of a Ray node: `resources` where given; else one CPU, and for a scoring
        cell of a CUDA `device` one GPU too (building a merge runs on the CPU)."""
        if self.resources is not None:
            return getattr(self.resources, kind).resources()
        return Resources(1.0, 1.0 if kind == "cell" and self.device.startswith("cuda") else 0.0)

    def check_tasks(self, extra_names: Sequence[str] = (), extra_paths: Sequence[str] = ()):
        """Every task file under the include paths reads and has lm-eval's fields; lm-eval knows every task named
        (and `extra_names`, under `extra_paths` too); code tasks only with `allow_code_execution`. Returns the
        lm-eval `TaskManager` that knows them (None when none is named)."""
        check_task_files([*self.include_paths(), *extra_paths])
        names = [*self.task.names, *extra_names, *([self.merge_selection.task] if self.merge_selection else [])]
        if not names:
            return None
        manager = check_task_names(list(dict.fromkeys(names)), [*self.include_paths(), *extra_paths])
        if self.merge_selection is not None and self.merge_selection.split is not None:
            kind = task_kind(manager, self.merge_selection.task)
            if kind not in ("task", "py_task"):
                raise ValueError(
                    f"`merge_selection.split` replaces a task's test split; {self.merge_selection.task!r} "
                    f"is a {kind}, name one of its tasks instead"
                )
        unsafe = unsafe_tasks(manager, names)
        if unsafe and not self.allow_code_execution:
            raise ValueError(
                f"tasks {unsafe} execute model-written code; "
                "set `allow_code_execution: true` in the config to run them "
                "(lm-eval's confirm_run_unsafe_code), preferably in a sandbox"
            )
        return manager


def check_expert_name(name: str) -> None:
    """An expert's name: non-empty, without '/', not starting with a system prefix (`RESERVED_PREFIXES`)."""
    if not name or "/" in name or name.startswith(RESERVED_PREFIXES):
        raise ValueError(
            f"expert names must be non-empty, without '/' and not start with {RESERVED_PREFIXES}, got {name!r}"
        )


def check_composition_name(name: str) -> None:
    """A composition's name is a system name: not 'base', without '/', not starting with `RESERVED_PREFIXES`."""
    if name == "base" or "/" in name or name.startswith(RESERVED_PREFIXES):
        raise ValueError(
            f"`compositions` keys are system names: not 'base', without '/', not starting with "
            f"{RESERVED_PREFIXES}; got {name!r}"
        )


def resolve_paths(data: dict, folder: Path) -> dict:
    """`data` (a config mapping) with its relative local paths read from `folder`, made absolute: `task.include_path`,
    `native_run.folder`, `base` and each of `experts` (those that are local, `is_local` read from `folder`)."""
    data = dict(data)
    task = data.get("task")
    if isinstance(task, dict) and isinstance(task.get("include_path"), str):
        data["task"] = {**task, "include_path": _absolute(task["include_path"], folder)}
    run = data.get("native_run")
    if isinstance(run, dict) and isinstance(run.get("folder"), str):
        data["native_run"] = {**run, "folder": _absolute(run["folder"], folder)}
    if isinstance(data.get("base"), str):
        data["base"] = resolve_source(data["base"], folder)
    if isinstance(data.get("experts"), dict):
        data["experts"] = {
            name: resolve_source(source, folder) if isinstance(source, str) else source
            for name, source in data["experts"].items()
        }
    return data


def resolve_source(value: str, folder: Path) -> str:
    """A model source named in a config in `folder`: a local path (by `is_local`'s rules, read from `folder`) made
    absolute; a hub id (`owner/name` with no such local folder) unchanged."""
    path = Path(value).expanduser()
    if not value or path.is_absolute():
        return value
    candidate = folder / path
    local = (
        value.startswith((".", "~"))
        or len(path.parts) > 2
        or candidate.exists()
        or (len(path.parts) == 2 and candidate.parent.is_dir())
    )
    return _absolute(value, folder) if local else value


def _absolute(value: str, folder: Path) -> str:
    return value if not value else os.path.abspath(folder / Path(value).expanduser())


def source_kind(value: str, where: str) -> Literal["checkpoint", "adapter", "hub"]:
    """What a model source is: a local checkpoint folder, a local peft adapter folder, or a hub id.

    Local values (`mergecompose.core.sources.is_local`) must be existing checkpoint or adapter folders.
    A hub id is checked for its form only: a config names the same models wherever it is loaded,
    and whether a hub id loads (offline: whether the hub cache holds it) is checked when the run
    starts (`check_hub_sources`), before any work.
    """
    if is_local(value):
        return sources.source_kind(value, where)
    check_hub_id(value, where)
    return "hub"


def _check_base(value: str) -> str:
    return check_model_source(value, "base", adapter_hint="give its base as `base` and the adapter under `experts`")


def check_hub_sources(config: LmEvalCompareConfig) -> None:
    """Offline (HF_HUB_OFFLINE), refuse at once a hub id that the hub cache does not hold; online, nothing to do."""
    if not hub_offline():
        return
    if not is_local(config.base):
        _check_base(config.base)
    for name, source in config.experts.items():
        if not is_local(source):
            sources.source_kind(source, f"experts.{name}")
