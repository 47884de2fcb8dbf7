"""A run's results folder, the one skeleton of every runner (compare, lm-eval compare, the three sweeps).

    run = RunFolder(out_dir, COMPARE_FOLDER)          # the clock starts
    with run.claim(config_hash, overwrite):            # refused at once if another config's or another run's
        with run.stage("evaluation"):                  # seconds into run.timings["evaluation"]
            ...
        run.write_json("results.json", {..., "timings": {**run.timings, "total": run.elapsed()}})

* `claim`: refuse a folder that holds the results of another config (its results file records the
  config's fingerprint), or that is not a run folder of this kind; hold the folder's lock for the
  whole run (a second run on it is refused at once, naming the holder's pid); remove what killed
  runs left in it; check again under the lock, which sees what another run may have written meanwhile.
* `stage`: the seconds a named stage took, recorded in `timings` in the order the stages ran.
* `write_json`, `write_text`, `write_config`, `write_figure`: each file written atomically (a
  temporary file beside it, then a rename), so a run killed halfway leaves no half-written result.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from mergecompose.analysis.overlap_report import json_safe
from mergecompose.core.io import atomic_write_text, is_leftover_name, remove_leftovers
from mergecompose.core.locks import RUN_LOCK_NAME, run_folder_lock

# How the results folder is named in errors: the API's argument and the command line's flag.
OUT_DIR = "`out_dir` (--out)"

_OTHER_CONFIG = (
    "{folder} holds the results of another config (hash {previous}, this one is {current}); "
    "pass overwrite=True (--overwrite) to replace them, or choose another folder"
)


@dataclass(frozen=True)
class FolderLayout:
    """What one kind of run folder holds, and how its errors name it.

    `results`: the file that records the config's fingerprint under `hash_key`. `cached`: the
    entries kept between runs (trained checkpoints, cells, ...); with `own_entries_only`, a folder
    that holds anything else (and no results file) is not this kind of folder and is refused, before
    the lock file is put in it. `leftovers`: the subfolders cleared of killed runs' temporaries,
    besides the folder itself. `other_config`: the refusal of another config's folder, formatted
    with `folder`, `previous` and `current`.
    """

    kind: str
    results: str = "results.json"
    hash_key: str = "config_hash"
    cached: tuple[str, ...] = ("checkpoints",)
    leftovers: tuple[str, ...] = ("checkpoints",)
    own_entries_only: bool = True
    other_config: str = _OTHER_CONFIG
    # The entries this kind writes, where it writes few files into a folder and replaces none of the others: a folder
    # holding anything else is another command's, refused even with overwrite (which would mix the two).
    owns: tuple[str, ...] = ()


class Stopwatch:
    """Seconds since it was started, and per named stage (`with watch.stage(name):`), rounded as results record them."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.stages: dict[str, float] = {}

    def elapsed(self, digits: int = 2) -> float:
        return round(time.perf_counter() - self.started, digits)

    @contextlib.contextmanager
    def stage(self, name: str, digits: int = 2) -> Iterator[None]:
        """Record the block's seconds as `stages[name]` (when it finishes; a stage that raises records nothing)."""
        started = time.perf_counter()
        yield
        self.stages[name] = round(time.perf_counter() - started, digits)


class RunFolder:
    """One run's results folder: claimed by the config's fingerprint, locked, its stages timed, its files written
    atomically."""

    def __init__(self, path: str | os.PathLike, layout: FolderLayout):
        self.path = Path(path)
        self.layout = layout
        self.clock = Stopwatch()

    # ------------------------------------------------------------------------------ claiming

    @contextlib.contextmanager
    def claim(self, fingerprint: str, overwrite: bool = False) -> Iterator[RunFolder]:
        """Hold the folder (created if absent) for the block, refused unless it is this config's or a new one.

        Raises FileExistsError for a folder of another config or of something else (unless `overwrite`),
        and `mergecompose.core.locks.FolderInUseError` at once when another run holds it; so call this
        before any work, and a refusal costs nothing. Killed runs' temporaries are removed, each with a
        warning (`mergecompose.core.io.remove_leftovers`).
        """
        if self.layout.own_entries_only:  # keeps the lock file out of a folder that is not a run's
            self.check(fingerprint, overwrite)
        with run_folder_lock(self.path, OUT_DIR):
            for folder in (self.path, *(self.path / name for name in self.layout.leftovers)):
                remove_leftovers(folder)
            self.check(fingerprint, overwrite)
            yield self

    def check(self, fingerprint: str, overwrite: bool = False) -> None:
        """Refuse the folder unless it is absent, holds this config's results, or holds only the `cached` entries.

        With `overwrite`, any folder is accepted (and another config's results are replaced).
        """
        if not self.path.exists():
            return
        if not self.path.is_dir():
            raise ValueError(f"`out_dir` {str(self.path)!r} exists and is not a folder")
        if self.layout.owns:
            self._refuse_foreign_entries()
        results = self.path / self.layout.results
        if results.is_file():
            if not overwrite:
                previous = json.loads(results.read_text()).get(self.layout.hash_key)
                if previous != fingerprint:
                    message = self.layout.other_config.format(folder=self.path, previous=previous, current=fingerprint)
                    raise FileExistsError(message)
            return
        if self.layout.own_entries_only and not overwrite:
            kept = {*self.layout.cached, RUN_LOCK_NAME}
            others = sorted(path.name for path in self.path.iterdir() if path.name not in kept)
            if others:
                raise FileExistsError(
                    f"{self.path} exists and is not {self.layout.kind} (it holds {others[:5]}); "
                    "pass overwrite=True (--overwrite) or choose another folder"
                )

    def _refuse_foreign_entries(self) -> None:
        """Refuse a folder holding entries this kind does not write (`owns`), but killed runs' temporaries."""
        kept = {*self.layout.owns, *self.layout.cached, RUN_LOCK_NAME}
        others = sorted(
            path.name for path in self.path.iterdir() if path.name not in kept and not is_leftover_name(path.name)
        )
        if others:
            raise FileExistsError(
                f"{self.path} holds what another command wrote ({', '.join(others[:5])}), not {self.layout.kind}; "
                "choose a new folder (--overwrite replaces only this command's own files)"
            )

    # ------------------------------------------------------------------------------ timing

    def stage(self, name: str, digits: int = 2) -> contextlib.AbstractContextManager[None]:
        """`with run.stage(name):` records the block's seconds as `run.timings[name]`."""
        return self.clock.stage(name, digits)

    @property
    def timings(self) -> dict[str, float]:
        """The stages' seconds so far, in the order they ran."""
        return dict(self.clock.stages)

    def elapsed(self, digits: int = 2) -> float:
        """Seconds since the folder object was made (the run's total)."""
        return self.clock.elapsed(digits)

    # ------------------------------------------------------------------------------ writing

    def file(self, name: str) -> Path:
        return self.path / name

    def write_text(self, name: str, text: str) -> Path:
        path = self.file(name)
        atomic_write_text(path, text)
        return path

    def write_json(self, name: str, data: Any, finite: bool = False) -> Path:
        """`data` as JSON (indent 1); with `finite`, NaN written as null and ±inf as strings (`json_safe`)."""
        if finite:
            return self.write_text(name, json.dumps(json_safe(data), indent=1, allow_nan=False))
        return self.write_text(name, json.dumps(data, indent=1))

    def write_config(self, config: BaseModel, name: str = "config.yaml", **yaml_options: Any) -> Path:
        """The resolved config, loadable as it is."""
        return self.write_text(name, yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, **yaml_options))

    def write_figure(self, name: str, draw: Callable[[Path], object]) -> Path:
        """`draw(path)` saves the figure (atomically, through `mergecompose.core.io.atomic_save_figure`)."""
        path = self.file(name)
        draw(path)
        return path
