"""The built wheel holds exactly the source tree's modules under one import name, and installs on its own.

The wheel is built from a copy of the checkout's files (so nothing is written into the source tree) and
installed into a fresh venv, with the CPU build torch==2.13.0 installed first: an open range would pull a
CUDA build of several GB.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{command}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    checkout = tmp_path_factory.mktemp("checkout")
    listed = _run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT).stdout
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, checkout / name)
    out = tmp_path_factory.mktemp("dist")
    _run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out), "."],
        cwd=checkout,
    )
    (built,) = out.glob("mergecompose-*.whl")
    return built


def test_the_wheel_holds_every_module_of_the_source_tree_and_nothing_else(wheel, source_modules):
    names = zipfile.ZipFile(wheel).namelist()
    python_files = {name for name in names if name.endswith(".py")}
    expected = {
        "/".join(module.split(".")) + ("/__init__.py" if path.name == "__init__.py" else ".py")
        for module, path in source_modules.items()
    }
    assert python_files == expected
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == {"mergecompose"}
    assert "mergecompose/analysis/predict_rule.json" in names


def test_the_wheel_installs_and_runs_in_a_fresh_venv(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    # No bytecode compiled at install: the test imports a few modules, and compiling all of torch is most of the time.
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-compile"]
    _run([*pip, TORCH])
    _run([*pip, str(wheel)])
    work = tmp_path / "elsewhere"
    work.mkdir()
    helped = _run([str(venv / "bin" / "mergecompose"), "--help"], cwd=work)
    assert "usage: mergecompose" in helped.stdout
    python = [str(venv / "bin" / "python"), "-I", "-c"]
    imported = _run([*python, "import mergecompose.composition as c; print(c.ComposedLM.__name__)"], cwd=work)
    assert imported.stdout.strip() == "ComposedLM"
    for old_name in ("analysis", "composition", "merging", "tasks", "benchmarks", "mergecompose_cli"):
        refused = subprocess.run([*python, f"import {old_name}"], capture_output=True, text=True, cwd=work)
        assert refused.returncode != 0 and "ModuleNotFoundError" in refused.stderr, old_name
