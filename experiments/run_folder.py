"""What every run does with its results folder before writing into it (compares, sweeps, lm_eval compares).

* `hold_run_folder`: hold the folder's lock for the whole run (a second run on it is refused at
  once, naming the holder's pid), and clear what killed runs left in it;
* `check_run_dir`: refuse a folder that holds another config's results, or is not a run folder;
* `claim_run_dir`: both, for a compare.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Collection, Iterator
from pathlib import Path

from mergecompose.core.io import remove_leftovers
from mergecompose.core.locks import RUN_LOCK_NAME, run_folder_lock

# How the results folder is named in errors: the API's argument and the command line's flag.
OUT_DIR = "`out_dir` (--out)"


@contextlib.contextmanager
def hold_run_folder(out_dir: Path, subfolders: Collection[str] = ("checkpoints",)) -> Iterator[Path]:
    """Hold the exclusive lock on `out_dir` (created if absent) for the block; remove killed runs' leftovers.

    Raises `mergecompose.core.locks.FolderInUseError` at once when another run holds the folder. The
    temporaries of killed runs in `out_dir` and its `subfolders` are removed, each with a warning
    (`mergecompose.core.io.remove_leftovers`); call this before any work, so that a refusal costs nothing.
    """
    with run_folder_lock(out_dir, OUT_DIR):
        for folder in (out_dir, *(out_dir / name for name in subfolders)):
            remove_leftovers(folder)
        yield out_dir


@contextlib.contextmanager
def claim_run_dir(
    out_dir: Path,
    config_hash: str,
    overwrite: bool,
    kind: str,
    cached: Collection[str],
    subfolders: Collection[str] = ("checkpoints",),
    results_name: str = "results.json",
) -> Iterator[Path]:
    """`check_run_dir`, then `hold_run_folder` for the block, then `check_run_dir` again under the lock.

    The first check keeps the lock file (and the folder the lock creates) out of a folder that is
    not a run's; the second sees the results another run may have written meanwhile.
    """
    check_run_dir(out_dir, config_hash, overwrite, kind, cached, results_name)
    with hold_run_folder(out_dir, subfolders):
        check_run_dir(out_dir, config_hash, overwrite, kind, cached, results_name)
        yield out_dir


def check_run_dir(
    out_dir: Path,
    config_hash: str,
    overwrite: bool,
    kind: str,
    cached: Collection[str],
    results_name: str = "results.json",
) -> None:
    """Refuse `out_dir` unless it is absent, holds this config's results, or holds only `cached` entries.

    A folder with another config's results (`results_name`, a JSON with `config_hash`), or with entries other than the `cached` ones
    (checkpoints, cells, …, kept between runs) and the run lock, is refused unless `overwrite`;
    `kind` names the run folder in the error.
    """
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ValueError(f"`out_dir` {str(out_dir)!r} exists and is not a folder")
    results = out_dir / results_name
    if results.is_file():
        previous = json.loads(results.read_text()).get("config_hash")
        if previous != config_hash and not overwrite:
            raise FileExistsError(
                f"{out_dir} holds the results of another config (hash {previous}, this one is {config_hash}); "
                "pass overwrite=True (--overwrite) to replace them, or choose another folder"
            )
        return
    others = sorted(path.name for path in out_dir.iterdir() if path.name not in {*cached, RUN_LOCK_NAME})
    if others and not overwrite:
        raise FileExistsError(
            f"{out_dir} exists and is not {kind} (it holds {others[:5]}); "
            "pass overwrite=True (--overwrite) or choose another folder"
        )
