"""Files at the edge: atomic output folders and lazy reads of safetensors checkpoints."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def refuse_existing(out_dir: str | os.PathLike, overwrite: bool) -> Path:
    """Return `out_dir` as a Path; raise if it exists and `overwrite` is False."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"`out_dir` {str(out_dir)!r} already exists; pass overwrite=True to replace it")
    return out_dir


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder next to `out_dir`; on success rename it to `out_dir`.

    On an exception the temporary folder is removed and `out_dir` is left as it was (absent, or
    the old folder when overwriting). An existing `out_dir` is refused unless `overwrite=True`.
    """
    out_dir = refuse_existing(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    temporary = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    temporary.mkdir()
    try:
        yield temporary
        refuse_existing(out_dir, overwrite)  # something may have appeared meanwhile
        if out_dir.exists():
            trash = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(out_dir, trash)
            os.replace(temporary, out_dir)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(temporary, out_dir)
    finally:
        if temporary.exists():
            shutil.rmtree(temporary, ignore_errors=True)


class SafetensorsCheckpoint:
    """Read the tensors of a checkpoint folder one at a time (single file or sharded index)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ValueError(f"checkpoint folder {str(self.folder)!r} does not exist or is not a folder")
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: self.folder / file for name, file in weight_map.items()}
        elif single.exists():
            with safe_open(str(single), framework="pt") as handle:
                self._file_of = {name: single for name in handle.keys()}
        else:
            found = sorted(path.name for path in self.folder.iterdir())
            raise ValueError(
                f"checkpoint folder {str(self.folder)!r} has no model.safetensors or "
                f"model.safetensors.index.json (found {found}); only safetensors checkpoints are read"
            )
        self._handles: dict[Path, object] = {}

    def keys(self) -> list[str]:
        return list(self._file_of)

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def _handle(self, name: str):
        file = self._file_of[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file]
