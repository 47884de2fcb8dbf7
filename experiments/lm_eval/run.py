"""`mergecompose compare` for `type: lm_eval`: every system on every lm-eval task, cell by cell, resumable.

    OUT/config.yaml        the resolved config (written first)
    OUT/lm_eval_tasks/     the tiny tasks of `letters_run`, if any
    OUT/cache/             merges and dense LoRA experts, by hash (`mergecompose.experiments.lm_eval.systems`)
    OUT/cells/             one file per (system, task), written when it finishes (`mergecompose.experiments.lm_eval.cells`)
    OUT/samples/           lm-eval's per-sample logs, one jsonl per system and leaf task
    OUT/results.json, results.md, bars.png

Before any model loads, the task names and the code-execution opt-in are checked again (with the
tiny tasks written), and the folder is checked: one that holds the results of another config is
refused unless `overwrite`, and one that another run is writing is refused at once. A killed run,
restarted, evaluates only the cells it had not written (and removes the temporaries it left).
Merge grids with more than one point are chosen on `merge_selection` (best first, ties to the
first point); the other points' merged folders are then deleted (their scores stay in cells/).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import lm_eval.api.registry
import torch
import yaml
from tqdm.auto import tqdm

import mergecompose.integrations.lm_eval.model  # noqa: F401  (registers lm-eval's `composed` model)
from mergecompose.core.io import atomic_write_text
from mergecompose.experiments.config import fingerprint
from mergecompose.experiments.lm_eval.cells import CellStore, EvaluationSettings, TaskRun, folder_digest
from mergecompose.experiments.lm_eval.config import LmEvalCompareConfig, check_hub_sources
from mergecompose.experiments.lm_eval.report import plot_bars, results_table, write_markdown
from mergecompose.experiments.lm_eval.systems import (
    System,
    build_merge,
    composition_systems,
    plan_merge,
    single_systems,
)
from mergecompose.experiments.registry import register_compare_kind
from mergecompose.experiments.run_folder import claim_run_dir

# What a run folder may hold besides results.json before it counts as someone else's folder.
_RUN_ENTRIES = {"config.yaml", "lm_eval_tasks", "cache", "cells", "samples", "results.md", "bars.png"}


def run_lm_eval_compare(
    config: LmEvalCompareConfig,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    progress: bool = True,
    echo: Callable[[str], None] | None = print,
) -> dict:
    """Evaluate every system on every task (reusing finished cells) and write the results; returns results.json's content.

    With `allow_code_execution: true`, `HF_ALLOW_CODE_EVAL=1` is set for the run too: the code
    tasks' metric (HF evaluate's `code_eval`) refuses to execute anything without it.
    """
    with _code_execution(config.allow_code_execution):
        return _run(config, Path(out_dir), overwrite, progress, echo)


def _run(config: LmEvalCompareConfig, out_dir: Path, overwrite: bool, progress: bool, echo) -> dict:
    check_hub_sources(config)
    config_hash = fingerprint(config)
    with claim_run_dir(out_dir, config_hash, overwrite, "an lm_eval compare folder", _RUN_ENTRIES, ("cache", "cells")):
        return _run_locked(config, config_hash, out_dir, progress, echo)


def _run_locked(config: LmEvalCompareConfig, config_hash: str, out_dir: Path, progress: bool, echo) -> dict:
    started = time.perf_counter()
    atomic_write_text(out_dir / "config.yaml", yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))

    local_names, local_paths = [], []
    if config.letters_run is not None:
        local_names = config.letters_run.write_tasks(out_dir / "lm_eval_tasks")
        local_paths = [str(out_dir / "lm_eval_tasks")]
    manager = config.check_tasks(local_names, local_paths)  # names and the code opt-in, before any model loads
    task_names = [*config.task.names, *local_names]
    settings = EvaluationSettings(
        num_fewshot=config.task.num_fewshot,
        gen_kwargs=config.task.gen_kwargs,
        allow_code_execution=config.allow_code_execution,
        include_digest=folder_digest([*config.include_paths(), *local_paths]),
    )
    cells = CellStore(out_dir, settings, manager)
    cache = out_dir / "cache"
    timings: dict[str, float] = {}

    stage = time.perf_counter()
    systems = {**single_systems(config), **composition_systems(config)}
    merges = _merges(config, cells, cache, progress)
    for method, record in merges.items():
        systems[f"merge:{method}"] = record.pop("system")
    timings["merges"] = round(time.perf_counter() - stage, 2)

    stage = time.perf_counter()
    runs = [TaskRun(name, limit=config.task.limit) for name in task_names]
    evaluated = {}
    bar = tqdm(total=len(systems) * len(runs), desc="cells", disable=not progress, leave=False)
    for name, system in systems.items():
        with _Loader(system) as load:
            splits, samples, seconds = {}, {}, 0.0
            for run in runs:
                cell = cells.get(system, run, load)
                splits.update(cell["splits"])
                samples[run.name] = cell["samples"]  # relative to out_dir
                seconds += cell["seconds"]
                bar.update()
        evaluated[name] = {
            "model": system.model,
            "model_args": system.model_args,
            "splits": splits,
            "samples": samples,
            "seconds": round(seconds, 2),
        }
    bar.close()
    timings["evaluation"] = round(time.perf_counter() - stage, 2)
    timings["total"] = round(time.perf_counter() - started, 2)

    results = {
        "kind": "lm_eval",
        "config": config.model_dump(mode="json"),
        "config_hash": config_hash,
        "lm_eval_version": lm_eval.__version__,
        "tasks": task_names,
        "systems": evaluated,
        "merges": merges,
        "cells": {
            "evaluated": [list(cell) for cell in cells.evaluated],
            "reused": [list(cell) for cell in cells.reused],
        },
        "timings": timings,
    }
    atomic_write_text(out_dir / "results.json", json.dumps(results, indent=1))
    write_markdown(results, out_dir / "results.md")
    plot_bars(results, out_dir / "bars.png")
    if echo is not None:
        echo(results_table(results))
        echo(
            f"\nresults: {out_dir / 'results.json'}, {out_dir / 'results.md'}, {out_dir / 'bars.png'}; "
            f"per-sample logs: {out_dir / 'samples'}"
        )
    return results


def _merges(config: LmEvalCompareConfig, cells: CellStore, cache: Path, progress: bool) -> dict:
    """Each method's merge at its chosen grid point: `{"chosen", "folder", "validation", "system"}`."""
    merges = {}
    selection = config.merge_selection
    for method, grid in tqdm(config.merges.items(), desc="merges", disable=not progress, leave=False):
        builds = [plan_merge(config, method, params, cache) for params in grid.candidates()]
        record: dict = {"validation": []}
        if len(builds) > 1:
            task = TaskRun(selection.task, selection.split, selection.limit)
            scores = []
            for build in builds:
                system = build.system(f"merge:{method}@{_label(build.params)}", config)
                cell = cells.get(system, task, _merge_loader(config, build, cache, system))
                scores.append(_selection_score(cell, task.name, selection.metric))
                record["validation"].append({"params": build.params, "score": scores[-1][0], "split": scores[-1][1]})
            higher = scores[0][2] is not False
            best = max(
                range(len(builds)), key=lambda index: (scores[index][0] if higher else -scores[index][0], -index)
            )
            for index, build in enumerate(builds):  # only the chosen merge stays on disk
                if index != best and build.folder.is_dir():
                    shutil.rmtree(build.folder)
            record["selected_on"] = {"task": selection.task, "split": selection.split, "limit": selection.limit}
        else:
            best = 0
        chosen = builds[best]
        build_merge(config, chosen, cache)
        record.update(
            {"chosen": chosen.params, "folder": str(chosen.folder), "system": chosen.system(f"merge:{method}", config)}
        )
        merges[method] = record
    return merges


def _selection_score(cell: dict, task: str, metric: str | None) -> tuple[float, str, bool | None]:
    """(value, split, higher is better) of the selection metric in `cell`: `metric`'s split, else the first."""
    records = cell["splits"]
    if metric is None:
        split = next(iter(records), None)
    else:
        split = next(
            (key for key in records if key in (f"{task}/{metric}",) or key.startswith(f"{task}/{metric},")), None
        )
    if split is None:
        raise ValueError(f"`merge_selection.metric` {metric!r} is not a metric of {task!r}; it has {sorted(records)}")
    return records[split]["value"], split, records[split]["higher_is_better"]


def _label(params: dict) -> str:
    return ",".join(f"{key}={value}" for key, value in params.items()) or "default"


def _merge_loader(config: LmEvalCompareConfig, build, cache: Path, system: System) -> Callable:
    """Builds the merge (unless cached) and loads it, only when its cell is not on disk."""

    def load():
        build_merge(config, build, cache)
        return _load_model(system)

    return load


def _load_model(system: System):
    """lm-eval's model for `system` (`hf` or `composed`), built from its `model_args`."""
    return lm_eval.api.registry.get_model(system.model).create_from_arg_obj(dict(system.model_args), {})


@contextlib.contextmanager
def _code_execution(allowed: bool):
    previous = os.environ.get("HF_ALLOW_CODE_EVAL")
    if allowed:
        os.environ["HF_ALLOW_CODE_EVAL"] = "1"
    try:
        yield
    finally:
        if allowed and previous is None:
            del os.environ["HF_ALLOW_CODE_EVAL"]
        elif allowed:
            os.environ["HF_ALLOW_CODE_EVAL"] = previous


class _Loader:
    """Loads a system's lm-eval model on first use (cells on disk need none) and frees it on exit."""

    def __init__(self, system: System):
        self.system, self.model = system, None

    def __enter__(self):
        return self

    def __call__(self):
        if self.model is None:
            self.model = _load_model(self.system)
        return self.model

    def __exit__(self, *exc_info):
        self.model = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


register_compare_kind("lm_eval", LmEvalCompareConfig, run_lm_eval_compare)
