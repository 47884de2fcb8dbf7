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
from dataclasses import dataclass
from pathlib import Path

import lm_eval
import torch

from mergecompose.core.executor import Cell, CellRun, Executor, LocalExecutor, cell_runs, raise_if_failed, run_cells
from mergecompose.experiments.compare_config import fingerprint
from mergecompose.experiments.lm_eval.cells import CellSettings, CellStore, TaskRun, folder_digest
from mergecompose.experiments.lm_eval.lm_eval_config import LmEvalCompareConfig
from mergecompose.experiments.lm_eval.lm_eval_report import plot_bars, results_markdown, results_table
from mergecompose.experiments.lm_eval.lm_eval_systems import (
    MergeBuild,
    build_merge,
    composition_systems,
    dense_checkpoint,
    plan_merge,
    single_systems,
)
from mergecompose.experiments.lm_eval.preflight import LM_EVAL_FOLDER, check_before_work, preflight
from mergecompose.experiments.merge_selection import best_record
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
    executor: Executor | None = None,
) -> dict:
    """Evaluate every system on every task (reusing finished cells) and write the results; returns results.json's
    content.

    The cells (`mergecompose.core.executor`), run by `executor` (default: here, one after another): the LoRA experts
    made dense for the merges (`merges/experts`), each grid point's merge scored on `merge_selection`
    (`select/<method>/<i>`, where a grid has more than one point), each chosen merge built (`merges/<method>`), and
    each system on each task (`<system>/<task>`, waiting for its merge). A cell's result is its file under `cells/`
    (or the merge's folder under `cache/`); a failed cell is reported, the others go on, and `CellsFailed` is
    raised with no results.json written.

    With `allow_code_execution: true`, `HF_ALLOW_CODE_EVAL=1` is set for the run too: the code
    tasks' metric (HF evaluate's `code_eval`) refuses to execute anything without it.

    Everything the run needs is checked first, before any model loads (`preflight.check_before_work`).
    Without `progress`, lm-eval is silent too: its log lines, bars and `git describe`'s stderr
    (`mergecompose.integrations.lm_eval.quiet`).
    """
    check_before_work(config)
    return _run_checked(config, out_dir, overwrite=overwrite, progress=progress, echo=echo, executor=executor)


def _run_checked(
    config: LmEvalCompareConfig,
    out_dir: str | Path,
    *,
    overwrite: bool,
    progress: bool,
    echo: Callable | None,
    executor: Executor | None = None,
) -> dict:
    """The run, its checks passed: `LM_EVAL_KIND.run`, which `run_compare` calls after the kind's `preflight`."""
    with _code_execution(config.allow_code_execution), quiet_lm_eval(not progress):
        return _run(config, Path(out_dir), overwrite, progress, echo, executor or LocalExecutor())


def _run(config: LmEvalCompareConfig, out_dir: Path, overwrite: bool, progress: bool, echo, executor) -> dict:
    config_hash = fingerprint(config.model_dump(mode="json", exclude={"resources"}))
    run = RunFolder(out_dir, LM_EVAL_FOLDER)
    with run.claim(config_hash, overwrite):
        return _run_claimed(config, config_hash, run, progress, echo, executor)


def _run_claimed(
    config: LmEvalCompareConfig, config_hash: str, run: RunFolder, progress: bool, echo, executor: Executor
) -> dict:
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
    cache = out_dir / "cache"
    tasks = _Tasks(local_names, local_paths, settings)
    _STORES[_store_key(str(out_dir), tasks)] = CellStore(out_dir, settings, manager)  # this process's cells reuse it
    runs: dict[str, CellRun] = {}

    with run.stage("merges"):
        systems = {**single_systems(config), **composition_systems(config)}
        dense = "merges/experts"
        prepare = [Cell(dense, _dense_experts, (config, str(cache)), config.cell_resources("train"))]
        selections = [
            Cell(
                f"select/{method}/{index}",
                _selection_cell,
                (config, str(out_dir), tasks, method, index),
                config.cell_resources("cell"),
                after=(dense,),
            )
            for method, grid in config.merges.items()
            if len(grid.candidates()) > 1
            for index in range(len(grid.candidates()))
        ]
        if config.merges:
            runs.update(run_cells([*prepare, *selections], executor, progress, desc="merges (validation)"))
            raise_if_failed(runs)
        merges = _merges(config, runs, cache)
        for method, record in merges.items():
            systems[merge_name(method)] = record.pop("system")

    with run.stage("evaluation"):
        chosen = {method: record["chosen"] for method, record in merges.items()}
        cells = [
            Cell(
                f"merges/{method}",
                _merge_cell,
                (config, str(cache), method, chosen[method]),
                config.cell_resources("train"),
            )
            for method in merges
        ]
        merge_of = {merge_name(method): f"merges/{method}" for method in merges}
        cells += [
            Cell(
                f"{name}/{task}",
                _evaluation_cell,
                (config, str(out_dir), tasks, name, TaskRun(task, limit=config.task.limit), chosen),
                config.cell_resources("cell"),
                after=(merge_of[name],) if name in merge_of else (),
            )
            for name in systems
            for task in task_names
        ]
        try:
            evaluation = run_cells(cells, executor, progress, desc="cells")
        finally:
            _free_loaded()  # the last system's model, loaded here by the local executor
        runs.update(evaluation)
        raise_if_failed(runs)
        evaluated = {}
        for name, system in systems.items():
            splits, samples, seconds = {}, {}, 0.0
            for task in task_names:
                cell = evaluation[f"{name}/{task}"].value["cell"]
                splits.update(cell["splits"])
                samples[task] = cell["samples"]  # relative to out_dir
                seconds += cell["seconds"]
            evaluated[name] = {
                "model": system.load.model,
                "model_args": system.load.model_args,
                "splits": splits,
                "samples": samples,
                "seconds": round(seconds, 2),
            }
    scored = [run for run in runs.values() if run.ok and isinstance(run.value, dict) and "cell" in run.value]

    results = {
        "kind": "lm_eval",
        "config": config.model_dump(mode="json"),
        "config_hash": config_hash,
        "lm_eval_version": lm_eval.__version__,
        "tasks": task_names,
        "systems": evaluated,
        "merges": merges,
        "cells": {
            "evaluated": [run.value["key"] for run in scored if run.value["evaluated"]],
            "reused": [run.value["key"] for run in scored if not run.value["evaluated"]],
        },
        "timings": {**run.timings, "total": run.elapsed()},
        "executor": {"name": executor.name, "runs": cell_runs(runs)},
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


def _merges(config: LmEvalCompareConfig, runs: dict[str, CellRun], cache: Path) -> dict:
    """Each method's chosen grid point (the best on `merge_selection` where the grid has several):
    `{"chosen", "folder", "validation", "selected_on", "system"}`. The other points' merged folders are deleted."""
    merges = {}
    selection = config.merge_selection
    for method, grid in config.merges.items():
        builds = [plan_merge(config, method, params, cache) for params in grid.candidates()]
        record: dict = {"validation": []}
        best = 0
        if len(builds) > 1:
            scores = [
                {"method": method, "params": build.params, **runs[f"select/{method}/{index}"].value}
                for index, build in enumerate(builds)
            ]
            best = scores.index(best_record(scores, higher_is_better=scores[0]["higher_is_better"] is not False))
            record["validation"] = [
                {"params": entry["params"], "score": entry["score"], "split": entry["split"]} for entry in scores
            ]
            for index, build in enumerate(builds):  # only the chosen merge stays on disk
                if index != best and build.folder.is_dir():
                    shutil.rmtree(build.folder)
            record["selected_on"] = {"task": selection.task, "split": selection.split, "limit": selection.limit}
        record.update(
            {
                "chosen": builds[best].params,
                "folder": str(builds[best].folder),
                "system": builds[best].system(merge_name(method), config),
            }
        )
        merges[method] = record
    return merges


@dataclass(frozen=True)
class _Tasks:
    """What a cell needs to score: the tiny tasks' names and folder (written by the driver), lm-eval's settings."""

    local_names: list[str]
    local_paths: list[str]
    settings: CellSettings


# A process's cell store of each run folder (its lm-eval task manager indexes the tasks once), and the lm-eval
# model it loaded last (the local executor scores a system's tasks one after another on one load).
_STORES: dict[str, CellStore] = {}
_LOADED: dict[str, object] = {}


def _store(config: LmEvalCompareConfig, out_dir: str, tasks: _Tasks) -> CellStore:
    """The cell store of `out_dir` for these settings (a worker may serve several runs)."""
    key = _store_key(out_dir, tasks)
    if key not in _STORES:
        manager = config.check_tasks(tasks.local_names, tasks.local_paths)
        _STORES[key] = CellStore(Path(out_dir), tasks.settings, manager)
    return _STORES[key]


def _store_key(out_dir: str, tasks: _Tasks) -> str:
    return fingerprint(out_dir, tasks.local_names, tasks.local_paths, vars(tasks.settings))


def _loaded(system: System) -> Callable:
    """`system`'s lm-eval model, loaded on first use; the previously loaded system's is let go first."""

    key = fingerprint(system.name, system.identity, system.load.model, system.load.model_args)

    def load():
        if key not in _LOADED:
            _free_loaded()
            _LOADED[key] = system.load()
        return _LOADED[key]

    return load


def _free_loaded() -> None:
    _LOADED.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _dense_experts(config: LmEvalCompareConfig, cache: str) -> None:
    """The merged experts as full checkpoints (LoRA adapters made dense), once, before any merge is built."""
    for name in config.merged_experts():
        dense_checkpoint(config, name, Path(cache))


def _selection_cell(config: LmEvalCompareConfig, out_dir: str, tasks: _Tasks, method: str, index: int) -> dict:
    """One grid point's merge, built (unless cached) and scored on `merge_selection`: `{"score", "split",
    "higher_is_better"}`."""
    selection = config.merge_selection
    cache = Path(out_dir) / "cache"
    build = plan_merge(config, method, config.merges[method].candidates()[index], cache)
    system = build.system(merge_name(method, build.params), config)
    task = TaskRun(selection.task, selection.split, selection.limit)
    with _code_execution(config.allow_code_execution):  # in a Ray worker too
        cell = _store(config, out_dir, tasks).get(system, task, _merge_loader(config, build, cache, system))
    value, split, higher = _selection_score(cell, task.name, selection.metric)
    return {"score": value, "split": split, "higher_is_better": higher}


def _merge_cell(config: LmEvalCompareConfig, cache: str, method: str, params: dict) -> str:
    """The chosen merge of `method`, built unless cached: its folder."""
    return str(build_merge(config, plan_merge(config, method, params, Path(cache)), Path(cache)))


def _evaluation_cell(
    config: LmEvalCompareConfig, out_dir: str, tasks: _Tasks, name: str, task: TaskRun, chosen: dict[str, dict]
) -> dict:
    """System `name` on `task`: `{"cell", "evaluated", "key"}`, the cell from disk or scored now."""
    store = _store(config, out_dir, tasks)
    system = _system(config, Path(out_dir) / "cache", name, chosen)
    before = len(store.evaluated)
    with _code_execution(config.allow_code_execution):  # in a Ray worker too
        cell = store.get(system, task, _loaded(system))
    return {"cell": cell, "evaluated": len(store.evaluated) > before, "key": [name, task.name]}


def _system(config: LmEvalCompareConfig, cache: Path, name: str, chosen: dict[str, dict]) -> System:
    """The system called `name`: the base, an expert, a composition or a chosen merge."""
    for method, params in chosen.items():
        if merge_name(method) == name:
            return plan_merge(config, method, params, cache).system(name, config)
    return {**single_systems(config), **composition_systems(config)}[name]


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


LM_EVAL_KIND = CompareKind("lm_eval", LmEvalCompareConfig, _run_checked, preflight)  # an entry point
