"""One cell of the table: a system scored on one lm-eval task, written atomically, reused on the next run.

    ROOT/cells/<system>/<task>.json      the cell: its key, one record per metric, the sample counts
    ROOT/samples/<system>/<leaf>.jsonl   lm-eval's per-sample log of every leaf task under <task>

A cell is valid while its `key` (a hash of the system's model and its inputs, the task, the
lm-eval settings, the task files of `include_path` and lm-eval's version) is unchanged; samples
are written before the cell, so a cell on disk always has its samples.

Each metric becomes a split `<task>/<metric>` (`<task>/<metric>,<filter>` for lm-eval's filters
other than "none") in the compare schema: `{"value", "n", "ci95": [lo, hi], "interval",
"stderr", "higher_is_better"}`, and `"exact_match"` too for exact match. The 95 % interval is
Wilson's where every sample scored 0 or 1 (and the value is their mean), else
value ± 1.96 · lm-eval's stderr (None where lm-eval gives none).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import lm_eval
from lm_eval.utils import handle_non_serializable

from mergecompose.core.io import atomic_write_text
from mergecompose.experiments.compare_config import fingerprint
from mergecompose.experiments.evaluate import wilson_interval
from mergecompose.experiments.lm_eval.lm_eval_systems import slug
from mergecompose.experiments.run_folder import Stopwatch
from mergecompose.experiments.scored_systems import System


@dataclass(frozen=True)
class TaskRun:
    """One lm-eval task as a cell column: its name, optionally another split (merge selection) and a limit."""

    name: str
    split: str | None = None
    limit: int | None = None


@dataclass(frozen=True)
class CellSettings:
    """lm-eval's settings shared by every cell of a run."""

    num_fewshot: int | None
    gen_kwargs: dict | None
    allow_code_execution: bool
    include_digest: str  # a hash of the task files under the include paths


def folder_digest(folders) -> str:
    """A hash of every file under `folders` (the task YAMLs and their data): its path and content, both
    relative to its folder (the folder's own absolute path in a file reads as `<folder>`), so that a
    moved run folder keeps its cells."""
    digest = hashlib.sha256()
    for folder in map(Path, folders):
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                digest.update(str(path.relative_to(folder)).encode())
                digest.update(path.read_bytes().replace(str(folder.resolve()).encode(), b"<folder>"))
    return digest.hexdigest()[:16]


class CellStore:
    """Cells under `root/cells` and their samples under `root/samples`; which were evaluated in this run."""

    def __init__(self, root: Path, settings: CellSettings, manager):
        self.root = Path(root)
        self.cells_dir, self.samples_dir = self.root / "cells", self.root / "samples"
        self.settings, self.manager = settings, manager
        self.evaluated: list[tuple[str, str]] = []
        self.reused: list[tuple[str, str]] = []

    def key(self, system: System, task: TaskRun) -> str:
        return fingerprint(
            {
                "model": system.load.model,  # an lm-eval compare's systems load an `LmEvalModel`
                "identity": system.identity,
                "task": vars(task),
                "settings": vars(self.settings),
                "lm_eval": lm_eval.__version__,
            }
        )

    def path(self, system: System, task: TaskRun) -> Path:
        return self.cells_dir / slug(system.name) / f"{slug(task.name)}.json"

    def cached(self, system: System, task: TaskRun) -> dict | None:
        """The stored cell if it is valid for `system` and `task` now, else None."""
        path = self.path(system, task)
        if not path.is_file():
            return None
        cell = json.loads(path.read_text())
        return cell if cell.get("key") == self.key(system, task) else None

    def get(self, system: System, task: TaskRun, load_model) -> dict:
        """The cell, from disk or evaluated now with the lm-eval model `load_model()` returns (called only then;
        `system.load`, or a loader that keeps the model for the system's other cells)."""
        cell = self.cached(system, task)
        if cell is not None:
            self.reused.append((system.name, task.name))
            return cell
        watch = Stopwatch()
        model = load_model()
        try:
            results = lm_eval.simple_evaluate(
                model=model,
                tasks=[self._task_spec(task)],
                num_fewshot=self.settings.num_fewshot,
                limit=task.limit,
                gen_kwargs=self.settings.gen_kwargs,
                task_manager=self.manager,
                log_samples=True,
                confirm_run_unsafe_code=self.settings.allow_code_execution,
            )  # lm-eval's own fixed seeds (random, numpy, torch, few-shot sampling)
        except (ValueError, KeyError, AssertionError) as error:
            # lm-eval's errors about a task's data or settings name neither the task nor the system.
            raise ValueError(
                f"lm-eval failed scoring system {system.name!r} on task {task.name!r}: {type(error).__name__}: {error}"
            ) from error
        leaves = leaf_tasks(results, task.name)
        samples = {}
        for leaf in leaves:
            path = self.samples_dir / slug(system.name) / f"{slug(leaf)}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            lines = [
                json.dumps(sample, default=handle_non_serializable) + "\n"
                for sample in results["samples"].get(leaf, [])
            ]
            atomic_write_text(path, "".join(lines))
            samples[leaf] = str(path.relative_to(self.root))
        cell = {
            "system": system.name,
            "task": vars(task),
            "key": self.key(system, task),
            "splits": metric_records(results, task.name),
            "n_samples": {leaf: results["n-samples"][leaf] for leaf in leaves if leaf in results["n-samples"]},
            "samples": samples,
            "versions": {leaf: results["versions"].get(leaf) for leaf in leaves},
            "seconds": watch.elapsed(),
        }
        path = self.path(system, task)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(cell, indent=1, default=handle_non_serializable))
        self.evaluated.append((system.name, task.name))
        return cell

    def _task_spec(self, task: TaskRun):
        """The task name, or with `split` its lm-eval Task object with that split as the test split."""
        if task.split is None:
            return task.name
        loaded = self.manager.load([task.name])["tasks"][task.name]
        loaded.set_config(key="test_split", value=task.split)
        return loaded


def leaf_tasks(results: dict, name: str) -> list[str]:
    """The leaf tasks under `name` in lm-eval's results (itself when it is a task)."""
    children = results.get("group_subtasks", {}).get(name)
    if not children:
        return [name]
    return [leaf for child in children for leaf in leaf_tasks(results, child)]


def metric_records(results: dict, name: str) -> dict[str, dict]:
    """`{"<task>/<metric>[,<filter>]": record}` for every metric lm-eval reports for `name` (see the module
    docstring)."""
    metrics = results.get("results", {}).get(name) or results.get("groups", {}).get(name) or {}
    leaves = leaf_tasks(results, name)
    samples = [sample for leaf in leaves for sample in results.get("samples", {}).get(leaf, [])]
    higher = results.get("higher_is_better", {}).get(name, {})
    records = {}
    for key, value in metrics.items():
        if "," not in key or "_stderr," in key or not _is_number(value):
            continue
        metric, filter_name = key.split(",", 1)
        value = float(value)
        stderr = metrics.get(f"{metric}_stderr,{filter_name}")
        stderr = float(stderr) if _is_number(stderr) else None
        scores = [
            sample[metric] for sample in samples if sample.get("filter", "none") == filter_name and metric in sample
        ]
        binary = bool(scores) and all(
            (isinstance(score, bool) or _is_number(score)) and float(score) in (0.0, 1.0) for score in scores
        )
        successes = int(round(sum(float(score) for score in scores))) if binary else 0
        if binary and math.isclose(successes / len(scores), value, abs_tol=1e-9):
            n, ci, interval = len(scores), list(wilson_interval(successes, len(scores))), "wilson"
        else:
            n = sum(results["n-samples"][leaf]["effective"] for leaf in leaves if leaf in results.get("n-samples", {}))
            ci = [value - 1.96 * stderr, value + 1.96 * stderr] if stderr is not None else None
            interval = "stderr" if stderr is not None else None
        record = {
            "value": value,
            "n": n,
            "ci95": ci,
            "interval": interval,
            "stderr": stderr,
            "higher_is_better": higher.get(metric),
        }
        if metric == "exact_match":
            record["exact_match"] = value
        split = f"{name}/{metric}" if filter_name == "none" else f"{name}/{metric},{filter_name}"
        records[split] = record
    return records


def _is_number(value) -> bool:
    try:
        return not isinstance(value, (str, bool, list, tuple, dict)) and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False
