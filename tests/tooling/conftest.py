"""Fixtures of the tooling tests: the modules the source tree holds, as pyproject.toml's `package-dir` maps its
folders into `mergecompose`."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]


def package_dirs() -> dict[str, Path]:
    """{package: folder} from `[tool.setuptools] package-dir`."""
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {package: ROOT / folder for package, folder in settings["package-dir"].items()}


def _source_modules() -> dict[str, Path]:
    """{dotted module name: file} for every .py file under a mapped folder (an `__init__.py` names its package)."""
    modules = {}
    for package, folder in package_dirs().items():
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


@pytest.fixture(scope="session")
def source_modules() -> dict[str, Path]:
    """{dotted module name: file} for every .py file the source tree maps into `mergecompose`."""
    modules = _source_modules()
    assert len(modules) > 80, sorted(modules)  # the mapping sees the whole tree
    return modules
