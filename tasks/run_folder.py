"""The one check of a run folder before a comparison writes into it (synthetic-task and lm_eval compares alike)."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path


def check_run_dir(out_dir: Path, config_hash: str, overwrite: bool, kind: str, cached: Collection[str]) -> None:
    """Refuse `out_dir` unless it is absent, holds this config's results, or holds only `cached` entries.

    A folder with another config's `results.json`, or with entries other than the `cached` ones
    (checkpoints, cells, …, kept between runs), is refused unless `overwrite`; `kind` names the
    run folder in the error.
    """
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ValueError(f"`out_dir` {str(out_dir)!r} exists and is not a folder")
    results = out_dir / "results.json"
    if results.is_file():
        previous = json.loads(results.read_text()).get("config_hash")
        if previous != config_hash and not overwrite:
            raise FileExistsError(
                f"{out_dir} holds the results of another config (hash {previous}, this one is {config_hash}); "
                "pass overwrite=True (--overwrite) to replace them, or choose another folder"
            )
        return
    others = sorted(path.name for path in out_dir.iterdir() if path.name not in cached)
    if others and not overwrite:
        raise FileExistsError(
            f"{out_dir} exists and is not {kind} (it holds {others[:5]}); "
            "pass overwrite=True (--overwrite) or choose another folder"
        )
