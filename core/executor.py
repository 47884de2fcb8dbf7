"""Where the cells of a run execute: one after another in this process (`LocalExecutor`, the default), or as Ray
tasks on a cluster (`mergecompose.integrations.ray.RayExecutor`, `--executor ray`). On the ground floor, so that the
executors and the commands above them can all use it.

A **cell** is one unit of work of a command that caches per cell: a function and its (picklable) arguments, the
resources it asks for, and the cells it waits for (`after`: e.g. the experts a setting's measurement needs, trained
once by one cell). A cell writes its result itself, atomically, through its command's cache in the run folder, and
returns a small summary; the run folder is the truth, so a cell that runs again finds its result there. Every cell
records where it ran (node, pid) and its seconds.

`run_cells` runs them under one progress bar and returns each cell's `CellRun`: its value, or the error that stopped
it (the other cells go on; a cell whose dependency failed is not run). The command then reports the failed cells and
exits non-zero; a rerun finds the finished cells in the run folder and runs only the failed ones.
"""

from __future__ import annotations

import os
import platform
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from pydantic import Field
from tqdm.auto import tqdm

from mergecompose.core.io import StrictModel

EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class Resources:
    """What a cell asks of the machine that runs it (Ray's `num_cpus`, `num_gpus`); the local executor ignores it."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0


class CellResourcesConfig(StrictModel):
    """A config's `resources` for one kind of cell: what each such cell asks of a Ray node."""

    num_cpus: float = Field(default=1.0, gt=0)
    num_gpus: float = Field(default=0.0, ge=0)

    def resources(self) -> Resources:
        return Resources(self.num_cpus, self.num_gpus)


class ResourcesConfig(StrictModel):
    """A config's `resources` section: `train` for the cells that build what others wait for (the experts to train,
    the merges to build), `cell` for the cells that score. Not part of the config's fingerprint: where a cell runs
    does not change its result."""

    train: CellResourcesConfig = CellResourcesConfig()
    cell: CellResourcesConfig = CellResourcesConfig()


@dataclass(frozen=True)
class Cell:
    """One unit of work: `function(*args)`, run once the cells named in `after` have finished."""

    name: str
    function: Callable[..., Any]
    args: tuple = ()
    resources: Resources = Resources()
    after: tuple[str, ...] = ()


@dataclass
class CellRun:
    """What became of one cell: its `value`, or its `error` (one line) and `details` (the traceback)."""

    name: str
    value: Any = None
    error: str | None = None
    details: str = ""
    where: dict = field(default_factory=dict)  # {"node", "pid", "seconds"}

    @property
    def ok(self) -> bool:
        return self.error is None


class Executor(Protocol):
    name: str

    def run(self, cells: Sequence[Cell], on_done: Callable[[CellRun], None]) -> dict[str, CellRun]: ...


class CellsFailed(RuntimeError):
    """Some cells of a run failed; the others finished and are in the run folder. Rerun the command to run only the
    failed ones."""

    def __init__(self, failed: Sequence[CellRun]):
        self.failed = list(failed)
        lines = [f"{run.name}: {run.error}" for run in self.failed]
        super().__init__(
            f"{len(self.failed)} cell(s) failed (the others finished and are kept; rerun to run only these): "
            + "; ".join(lines)
        )


def run_in_worker(function: Callable[..., Any], args: tuple, threads: int) -> dict:
    """Run one cell where it is executed, with the driver's torch thread count; its value, node, pid and seconds."""
    torch.set_num_threads(threads)
    started = time.perf_counter()
    value = function(*args)
    return {
        "value": value,
        "where": {"node": platform.node(), "pid": os.getpid(), "seconds": round(time.perf_counter() - started, 2)},
    }


class LocalExecutor:
    """Each cell in this process, in the given order (dependencies first), as the commands ran before executors."""

    name = "local"

    def run(self, cells: Sequence[Cell], on_done: Callable[[CellRun], None]) -> dict[str, CellRun]:
        runs: dict[str, CellRun] = {}
        threads = torch.get_num_threads()
        for cell in cells:
            failed = [name for name in cell.after if not runs[name].ok]
            if failed:
                run = CellRun(cell.name, error=f"not run: {failed[0]} failed")
            else:
                try:
                    outcome = run_in_worker(cell.function, cell.args, threads)
                    run = CellRun(cell.name, value=outcome["value"], where=outcome["where"])
                except Exception as error:  # a cell's failure stops that cell only
                    run = CellRun(cell.name, error=one_line(error), details=traceback.format_exc())
            runs[cell.name] = run
            on_done(run)
        return runs


def run_cells(
    cells: Sequence[Cell], executor: Executor | None = None, progress: bool = True, desc: str = "cells"
) -> dict[str, CellRun]:
    """Run `cells` with `executor` (default: local) under one progress bar; {name: CellRun} in the cells' order."""
    names = [cell.name for cell in cells]
    if len(set(names)) != len(names):
        raise ValueError(f"cell names must be unique, got {names}")
    known: set[str] = set()
    for cell in cells:
        missing = [name for name in cell.after if name not in known]
        if missing:
            raise ValueError(f"cell {cell.name!r} waits for {missing[0]!r}, which is not an earlier cell")
        known.add(cell.name)
    executor = executor or LocalExecutor()
    bar = tqdm(total=len(cells), desc=desc, disable=not progress, leave=False)

    def on_done(run: CellRun) -> None:
        bar.update()
        if not run.ok:
            bar.write(f"cell {run.name} failed: {run.error}")

    try:
        runs = executor.run(cells, on_done)
    finally:
        bar.close()
    return {name: runs[name] for name in names}


def raise_if_failed(runs: dict[str, CellRun]) -> None:
    failed = [run for run in runs.values() if not run.ok]
    if failed:
        raise CellsFailed(failed)


def cell_runs(runs: dict[str, CellRun]) -> dict[str, dict]:
    """{cell: {"node", "pid", "seconds"}} of the cells that ran in this run (for results.json: where each ran)."""
    return {name: dict(run.where) for name, run in runs.items() if run.ok}


def one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return " ".join(text.split())
