"""An output folder that is, contains or lies inside an input is refused, even with --overwrite.

The input is left unchanged.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat

import pytest
import yaml

from mergecompose.cli import main
from mergecompose.core.io import atomic_output_dir, atomic_write_text, refuse_output_over_inputs
from mergecompose.merging import combine_lora_adapters


def _digest(folder) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.fixture()
def work(checkpoints, tmp_path):
    """A copy of the saved checkpoints (base/, expert_0/, expert_1/) and a mergekit config over them."""
    root = tmp_path / "work"
    shutil.copytree(checkpoints, root)
    config = {
        "merge_method": "task_arithmetic",
        "base_model": str(root / "base"),
        "models": [{"model": str(root / f"expert_{i}"), "parameters": {"weight": 0.5}} for i in range(2)],
        "dtype": "float32",
    }
    (tmp_path / "merge.yaml").write_text(yaml.safe_dump(config))
    return root, tmp_path / "merge.yaml"


@pytest.mark.parametrize("out", ["work", "work/base", "work/base/inside", "work/expert_1"])
def test_merge_refuses_an_output_over_its_inputs_even_with_overwrite(work, capsys, out):
    root, config = work
    before = _digest(root)
    target = root.parent / out
    assert main(["merge", str(config), "--out", str(target), "--overwrite"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("mergecompose merge: error:") and "lies inside the input" in error[0]
    assert _digest(root) == before


def test_merge_still_writes_beside_its_inputs(work, capsys):
    root, config = work
    assert main(["merge", str(config), "--out", str(root.parent / "merged")]) == 0
    assert (root.parent / "merged" / "config.json").is_file()


def test_combining_adapters_into_one_of_them_is_refused(lora_dirs, base_model, tmp_path):
    adapters = {name: shutil.copytree(folder, tmp_path / name) for name, folder in lora_dirs.items()}
    before = {name: _digest(folder) for name, folder in adapters.items()}
    with pytest.raises(ValueError, match="lies inside the input"):
        combine_lora_adapters(base_model, adapters, adapters["ab"], overwrite=True)
    assert {name: _digest(folder) for name, folder in adapters.items()} == before


def test_inputs_that_are_not_local_folders_are_skipped(tmp_path):
    refuse_output_over_inputs(tmp_path / "out", ["google/gemma-2-2b", None, object(), tmp_path / "missing"])
    with pytest.raises(ValueError, match="`out`"):
        refuse_output_over_inputs(tmp_path, [tmp_path / "data.jsonl", tmp_path], "`out`")


def test_atomic_writes_give_files_the_users_umask(tmp_path):
    previous = os.umask(0o027)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
        assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o640
        with atomic_output_dir(tmp_path / "folder") as folder:
            (folder / "b.txt").write_text("y")
        assert stat.S_IMODE((tmp_path / "folder").stat().st_mode) == 0o750
    finally:
        os.umask(previous)
