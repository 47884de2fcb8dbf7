"""`mergecompose compare` for `type: lm_eval`: every system on every lm-eval task, cell by cell, resumable.

    OUT/config.yaml        the resolved config (written first)
    OUT/lm_eval_tasks/     the tiny tasks of `native_run`, if any
    OUT/cache/             merges and dense LoRA experts, by hash (`mergecompose.experiments.lm_eval.lm_eval_systems`)
    OUT/cells/             one file per (system, task), written when it finishes
                           (`mergecompose.experiments.lm_eval.cells`)
    OUT/samples/           lm-eval's per-sample logs, one jsonl per system and leaf task
    OUT/results.json, results.md, bars.png

Before any model loads, `mergecompose.experiments.lm_eval.preflight.check_before_work` checks what the
last step needs (devices, sources, vocabularies, task files, generation settings, the selection
metric); the task names and the code-execution opt-in are checked again (with the
tiny tasks written), and the folder is checked: one that holds the results of another config is
refused unless `overwrite`, and one that another run is writing is refused at once. A killed run,
restarted, evaluates only the cells it had not written (and removes the temporaries it left).
Merge grids with more than one point are chosen on `merge_selection` (best first, ties to the
first point); the other points' merged folders are then deleted (their scores stay in cells/).
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import lm_eval
import torch
from tqdm.auto import tqdm

from mergecompose.experiments.compare_config import fingerprint
from mergecompose.experiments.lm_eval.cells import CellSettings, CellStore, TaskRun, folder_digest
from mergecompose.experiments.lm_eval.lm_eval_config import LmEvalCompareConfig
from mergecompose.experiments.lm_eval.lm_eval_report import plot_bars, results_markdown, results_table
from mergecompose.experiments.lm_eval.lm_eval_systems import (
    MergeBuild,
    build_merge,
    composition_systems,
    plan_merge,
    single_systems,
)
from mergecompose.experiments.lm_eval.preflight import LM_EVAL_FOLDER, check_before_work, preflight
from mergecompose.experiments.merge_selection import best_record, search_merges
from mergecompose.experiments.plugins import CompareKind
from mergecompose.experiments.run_folder import RunFolder
from mergecompose.experiments.scored_systems import System, merge_name
from mergecompose.integrations.lm_eval.quiet import quiet_lm_eval


def run_lm_eval_compare(
    config: LmEvalCompareConfig,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    progress: bool = True,
    echo: Callable[[str], None] | None = print,
) -> dict:
    """Evaluate every system on every task (reusing finished cells) and write the results; returns results.json's
    content.

    With `allow_code_execution: true`, `HF_ALLOW_CODE_EVAL=1` is set for the run too: the code
    tasks' metric (HF evaluate's `code_eval`) refuses to execute anything without it.

    Everything the run needs is checked first, before any model loads (`preflight.check_before_work`).
    Without `progress`, lm-eval is silent too: its log lines, bars and `git describe`'s stderr
    (`mergecompose.integrations.lm_eval.quiet`).
    """
    check_before_work(config)
    return _run_checked(config, out_dir, overwrite=overwrite, progress=progress, echo=echo)


def _run_checked(
    config: LmEvalCompareConfig, out_dir: str | Path, *, overwrite: bool, progress: bool, echo: Callable | None
) -> dict:
    """The run, its checks passed: `LM_EVAL_KIND.run`, which `run_compare` calls after the kind's `preflight`."""
    with _code_execution(config.allow_code_execution), quiet_lm_eval(not progress):
        return _run(config, Path(out_dir), overwrite, progress, echo)


def _run(config: LmEvalCompareConfig, out_dir: Path, overwrite: bool, progress: bool, echo) -> dict:
    config_hash = fingerprint(config)
    run = RunFolder(out_dir, LM_EVAL_FOLDER)
    with run.claim(config_hash, overwrite):
        return _run_claimed(config, config_hash, run, progress, echo)


def _run_claimed(config: LmEvalCompareConfig, config_hash: str, run: RunFolder, progress: bool, echo) -> dict:
    out_dir = run.path
    run.write_config(config)

    local_names, local_paths = [], []
    if config.native_run is not None:
        local_names = config.native_run.write_tasks(out_dir / "lm_eval_tasks")
        local_paths = [str(out_dir / "lm_eval_tasks")]
    manager = config.check_tasks(local_names, local_paths)  # names and the code opt-in, before any model loads
    task_names = [*config.task.names, *local_names]
    settings = CellSettings(
        num_fewshot=config.task.num_fewshot,
        gen_kwargs=config.task.gen_kwargs,
        allow_code_execution=config.allow_code_execution,
        include_digest=folder_digest([*config.include_paths(), *local_paths]),
    )
    cells = CellStore(out_dir, settings, manager)
    cache = out_dir / "cache"

    with run.stage("merges"):
        systems = {**single_systems(config), **composition_systems(config)}
        merges = _merges(config, cells, cache, progress)
        for method, record in merges.items():
            systems[merge_name(method)] = record.pop("system")

    with run.stage("evaluation"):
        runs = [TaskRun(name, limit=config.task.limit) for name in task_names]
        evaluated = {}
        bar = tqdm(total=len(systems) * len(runs), desc="cells", disable=not progress, leave=False)
        for name, system in systems.items():
            with _Loader(system) as load:
                splits, samples, seconds = {}, {}, 0.0
                for task in runs:
                    cell = cells.get(system, task, load)
                    splits.update(cell["splits"])
                    samples[task.name] = cell["samples"]  # relative to out_dir
                    seconds += cell["seconds"]
                    bar.update()
            evaluated[name] = {
                "model": system.load.model,
                "model_args": system.load.model_args,
                "splits": splits,
                "samples": samples,
                "seconds": round(seconds, 2),
            }
        bar.close()

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
        "timings": {**run.timings, "total": run.elapsed()},
    }
    run.write_json("results.json", results)
    run.write_text("results.md", results_markdown(results))
    run.write_figure("bars.png", lambda path: plot_bars(results, path))
    if echo is not None:
        echo(results_table(results))
        echo(
            f"\nresults: {run.file('results.json')}, {run.file('results.md')}, {run.file('bars.png')}; "
            f"per-sample logs: {run.file('samples')}"
        )
    return results


def _merges(config: LmEvalCompareConfig, cells: CellStore, cache: Path, progress: bool) -> dict:
    """Each method's merge at its chosen grid point: `{"chosen", "folder", "validation", "system"}`."""
    merges = {}
    selection = config.merge_selection
    for method, grid in tqdm(config.merges.items(), desc="merges", disable=not progress, leave=False):
        builds = [plan_merge(config, method, params, cache) for params in grid.candidates()]
        record: dict = {"validation": []}
        best = 0
        if len(builds) > 1:
            record["validation"], best = _select(config, cells, cache, method, builds)
            for index, build in enumerate(builds):  # only the chosen merge stays on disk
                if index != best and build.folder.is_dir():
                    shutil.rmtree(build.folder)
            record["selected_on"] = {"task": selection.task, "split": selection.split, "limit": selection.limit}
        chosen = builds[best]
        build_merge(config, chosen, cache)
        record.update(
            {"chosen": chosen.params, "folder": str(chosen.folder), "system": chosen.system(merge_name(method), config)}
        )
        merges[method] = record
    return merges


def _select(
    config: LmEvalCompareConfig, cells: CellStore, cache: Path, method: str, builds: list[MergeBuild]
) -> tuple[list[dict], int]:
    """Every grid point's score on `merge_selection` (`{"params", "score", "split"}`), and the best one's index.

    A merge is built (unless cached) only where its cell on the selection task is not on disk yet.
    """
    selection = config.merge_selection
    task = TaskRun(selection.task, selection.split, selection.limit)
    by_name = {merge_name(method, build.params): build for build in builds}

    def merge_system(method: str, params: dict) -> System:
        return by_name[merge_name(method, params)].system(merge_name(method, params), config)

    def selection_score(system: System) -> dict:
        cell = cells.get(system, task, _merge_loader(config, by_name[system.name], cache, system))
        value, split, higher = _selection_score(cell, task.name, selection.metric)
        return {"score": value, "split": split, "higher_is_better": higher}

    grid = {method: [build.params for build in builds]}
    scores = search_merges(grid, merge_system, selection_score, progress=False)
    best = best_record(scores, higher_is_better=scores[0]["higher_is_better"] is not False)
    validation = [{"params": entry["params"], "score": entry["score"], "split": entry["split"]} for entry in scores]
    return validation, scores.index(best)


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


def _merge_loader(config: LmEvalCompareConfig, build: MergeBuild, cache: Path, system: System) -> Callable:
    """Builds the merge (unless cached) and loads it, only when its cell is not on disk."""

    def load():
        build_merge(config, build, cache)
        return system.load()

    return load


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
            self.model = self.system.load()
        return self.model

    def __exit__(self, *exc_info):
        self.model = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


LM_EVAL_KIND = CompareKind("lm_eval", LmEvalCompareConfig, _run_checked, preflight)  # an entry point
