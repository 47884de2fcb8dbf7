"""A native seq2seq compare run as the source of a `type: lm_eval` compare: its systems, and its test strings as
local lm-eval tasks, so that one answer can be checked along both evaluation paths.

**Tasks** (a jsonl and a task YAML each, `dataset_path: json` with an absolute `data_files`):

* `generate_until`, scored by exact match: the prompt is the seq2seq prompt text
  `x_1 … x_L<eos><sep>` (the character tokenizer maps the literal `<eos>` and `<sep>` to its special
  ids), the target the joint target; generation stops at `<eos>` or after the longest target + 2 tokens,
  as the native greedy check does. Exact match of this greedy output is the native run's exact match.
* `multiple_choice` (loglikelihood), where the task type gives choices (`lm_eval_choices`; the letters task
  does): the same prompt, each choice ending in `<eos>`; `acc` is how often the right one has the highest
  summed log-probability.

**NativeRun** points a `type: lm_eval` compare at a native run (`mergecompose compare
configs/letters.yaml`): its base, experts (full, and LoRA where trained), its compositions and its
merges at the hyperparameters that run chose, and tasks from the strings it scored (regenerated
with the task type's `eval_data` from the run's resolved config). lm-eval passes no position ids,
so the setting must use contiguous positions (`variants.contiguous` of `configs/letters.yaml`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from mergecompose.core.io import atomic_write_text
from mergecompose.experiments.compare_config import CompareConfig
from mergecompose.experiments.evaluate import JOINT, EvalSet
from mergecompose.experiments.tokenizer import EOS, SEP


def prompt_text(source: str) -> str:
    """The seq2seq prompt as text: the input, its terminator, the separator."""
    return f"{source}{EOS}{SEP}"


def write_generate_task(folder: str | Path, name: str, pairs: Sequence[tuple[str, str]], max_gen_toks: int) -> str:
    """A `generate_until` task `name` in `folder` from (source, target) strings, scored by exact match."""
    records = [{"source": source, "prompt": prompt_text(source), "target": target} for source, target in pairs]
    config = {
        "output_type": "generate_until",
        "doc_to_target": "target",
        "generation_kwargs": {"until": [EOS], "max_gen_toks": max_gen_toks, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    }
    return _write_task(Path(folder), name, records, config)


def write_choice_task(folder: str | Path, name: str, items: Sequence[tuple[str, Sequence[str], int]]) -> str:
    """A `multiple_choice` task `name` from (source, choices, index of the right one); each choice ends in `<eos>`."""
    records = [
        {
            "source": source,
            "prompt": prompt_text(source),
            "choices": [f"{choice}{EOS}" for choice in choices],
            "label": label,
        }
        for source, choices, label in items
    ]
    config = {
        "output_type": "multiple_choice",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    return _write_task(Path(folder), name, records, config)


def _write_task(folder: Path, name: str, records: list[dict], config: dict) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    data = (folder / f"{name}.jsonl").resolve()
    atomic_write_text(data, "".join(json.dumps(record) + "\n" for record in records))
    task = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "doc_to_text": "prompt",
        "target_delimiter": "",  # the continuation follows `<sep>` directly
        **config,
        "metadata": {"version": 1.0},
    }
    atomic_write_text(folder / f"{name}.yaml", yaml.safe_dump(task, sort_keys=False))
    return name


class NativeRun(BaseModel):
    """A native seq2seq compare run (its folder, and `variant`, or None for its main setting) as an lm_eval
    compare's source.

    `splits`: test splits written as `generate_until` tasks `<task type>_<split>`; `choice_split`: the split
    written as the multiple-choice task `<task type>_<split>_choice` (None: none), for a task type that gives its
    choices (`lm_eval_choices(source) -> (choices, index of the right one)`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    folder: str
    variant: str | None = None
    splits: list[str] = Field(default_factory=lambda: [JOINT], min_length=1)
    choice_split: str | None = JOINT

    @model_validator(mode="after")
    def _usable(self):
        results = self._results
        if self.variant is not None and self.variant not in results.get("variants", {}):
            raise ValueError(
                f"`native_run.variant` {self.variant!r} is not a variant of {self.folder!r}; "
                f"it has {sorted(results.get('variants', {}))}"
            )
        config = self.setting
        if config.task.formulation != "seq2seq":
            raise ValueError(
                f"`native_run` needs a seq2seq run, got {config.task.type!r} / {config.task.formulation!r}"
            )
        if self.choice_split is not None and not hasattr(config.task, "lm_eval_choices"):
            raise ValueError(
                f"`native_run.choice_split`: the task type {config.task.type!r} gives no multiple choices; "
                "set `choice_split: null`"
            )
        if config.positions.scheme != "contiguous":
            raise ValueError(
                f"`native_run`: the setting {self.variant or 'main'!r} of {self.folder!r} uses "
                f"{config.positions.scheme!r} positions; lm-eval passes no position ids, so only a setting with "
                "contiguous positions is scored the same way (e.g. `variant: contiguous` of configs/letters.yaml)"
            )
        known = list(self.native_systems()["base"]["splits"])
        unknown = [split for split in [*self.splits, *self._choice_splits()] if split not in known]
        if unknown:
            raise ValueError(f"`native_run` splits {unknown} are not test splits of that run; valid: {known}")
        return self

    def _choice_splits(self) -> list[str]:
        return [] if self.choice_split is None else [self.choice_split]

    @cached_property
    def _results(self) -> dict:
        path = Path(self.folder) / "results.json"
        if not path.is_file():
            raise ValueError(f"`native_run.folder` {self.folder!r} holds no results.json of a finished compare run")
        return json.loads(path.read_text())

    @cached_property
    def setting(self) -> CompareConfig:
        """The resolved config of the setting (the run's config, or its variant)."""
        config = CompareConfig.model_validate(self._results["config"])
        return config if self.variant is None else config.variant_configs()[self.variant]

    def _prefix(self) -> str:
        return "" if self.variant is None else f"{self.variant}/"

    def native_systems(self) -> dict[str, dict]:
        """The setting's systems as the native run scored them (results.json records, names without the variant
        prefix)."""
        prefix = self._prefix()
        return {
            name[len(prefix) :]: record
            for name, record in self._results["systems"].items()
            if name.startswith(prefix) and "/" not in name[len(prefix) :]
        }

    def system_fields(self) -> dict:
        """`base`, `experts`, `compositions`, `merges` (at the chosen points), `merge_experts`, `seed_merges`."""
        record = self._results if self.variant is None else self._results["variants"][self.variant]
        paths = {label: self._checkpoint(entry["path"]) for label, entry in record["training"].items()}
        config = self.setting
        experts = {}
        for skill in config.task.trained_skills():
            experts[skill] = paths[f"expert-{skill}"]
            if f"lora-{skill}" in paths:
                experts[f"{skill}:lora"] = paths[f"lora-{skill}"]
        joint = list(config.task.joint)
        compositions = {"compose": {"experts": joint}}
        for name, remedy in config.remedies.items():
            compositions[f"compose+{name}"] = {"experts": joint, "remedies": remedy.model_dump(exclude_defaults=True)}
        if all(f"{skill}:lora" in experts for skill in joint):
            compositions["compose:lora"] = {"experts": [f"{skill}:lora" for skill in joint]}
        merges = {
            method: {name: [value] for name, value in chosen["chosen"].items()}
            for method, chosen in record["merges"].items()
        }
        return {
            "base": paths["base"],
            "experts": experts,
            "compositions": compositions,
            "merges": merges,
            "merge_experts": joint,
            "seed_merges": config.seed_merges,
        }

    def _checkpoint(self, recorded: str) -> str:
        """A checkpoint path as results.json records it: relative to the working directory of that run, so
        one relative path is read as the same entry of this run folder's `checkpoints/` when that exists."""
        path = Path(recorded)
        here = Path(self.folder) / "checkpoints" / path.name
        return str(here) if not path.is_absolute() and here.is_dir() else recorded

    def eval_sets(self) -> dict[str, EvalSet]:
        """The setting's test splits, regenerated from its config: the strings the native run scored."""
        config = self.setting
        data = config.task.eval_data(config.evaluation, config.eval_length, config.task.train_lengths[1])
        return data.test

    def write_tasks(self, folder: str | Path) -> list[str]:
        """Write `<type>_<split>` (generate_until) and `<type>_<choice_split>_choice` into `folder`; their names."""
        sets = self.eval_sets()
        native = self.native_systems()["base"]["splits"]
        for split in {*self.splits, *self._choice_splits()}:
            if len(sets[split]) != native[split]["n"]:  # the same strings, or the equality means nothing
                raise ValueError(
                    f"regenerated split {split!r} has {len(sets[split])} strings, the run scored {native[split]['n']}"
                )
        names = []
        for split in self.splits:
            eval_set = sets[split]
            max_gen_toks = self.setting.task.max_target_length(eval_set.length) + 2
            names.append(
                write_generate_task(
                    folder,
                    f"{self.setting.task.type}_{split}",
                    list(zip(eval_set.sources, eval_set.targets)),
                    max_gen_toks,
                )
            )
        if self.choice_split is not None:
            task = self.setting.task
            items = [(source, *task.lm_eval_choices(source)) for source in sets[self.choice_split].sources]
            if any(len(set(choices)) < len(choices) for _, choices, _ in items):
                raise ValueError(
                    f"`native_run.choice_split` {self.choice_split!r} has inputs whose three choices coincide; "
                    f"use a split whose choices differ (for letters, {JOINT!r}, where every joint skill is active)"
                )
            names.append(write_choice_task(folder, f"{task.type}_{self.choice_split}_choice", items))
        return names
