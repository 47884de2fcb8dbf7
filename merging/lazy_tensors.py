"""Lazy reads of safetensors checkpoints, tensor by tensor (atomic writes: `mergecompose.core.io`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from mergecompose.core.boundary import check_checkpoint, check_safetensors_file, check_sharded_index
from mergecompose.core.sources import CONFIG


class SafetensorsCheckpoint:
    """Read the tensors of a checkpoint folder one at a time (single file or sharded index)."""

    def __init__(self, folder: str | os.PathLike, argument: str = "checkpoint"):
        self.folder = Path(folder).expanduser()
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        if (self.folder / CONFIG).exists() or not (index.exists() or single.exists()):
            # names a missing folder, an adapter folder, a folder without config.json, a truncated weights file
            check_checkpoint(folder, argument)
        if index.exists():
            check_sharded_index(index, argument)
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: self.folder / file for name, file in weight_map.items()}
        elif single.exists():
            check_safetensors_file(single, argument)
            with safe_open(str(single), framework="pt") as handle:
                self._file_of = {name: single for name in handle.keys()}
        elif not self.folder.is_dir():
            raise ValueError(
                f"`{argument}` {str(folder)!r} is not a local folder; "
                "checkpoints are read from local safetensors folders"
            )
        else:
            found = sorted(path.name for path in self.folder.iterdir())
            raise ValueError(
                f"`{argument}` {str(folder)!r} has no model.safetensors or "
                f"model.safetensors.index.json (found {found}); only safetensors checkpoints are read"
            )
        self._handles: dict[Path, safe_open] = {}

    def keys(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def is_floating_point(self, name: str) -> bool:
        """From the file's header (safetensors dtype codes: F16, BF16, F32, F64, F8_*), without reading the tensor."""
        return self._handle(name).get_slice(name).get_dtype().startswith(("F", "BF"))

    def _handle(self, name: str) -> safe_open:
        file = self._file_of[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file]
