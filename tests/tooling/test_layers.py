"""The packages are layers (composition → merging → analysis → tasks → benchmarks), with no import hidden in a function."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("composition", "merging", "analysis", "tasks", "benchmarks")


def _function_level_project_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.Import):
                names = [alias.name for alias in inner.names]
            elif isinstance(inner, ast.ImportFrom) and inner.level == 0 and inner.module:
                names = [inner.module]
            else:
                continue
            for name in names:
                if name.split(".")[0] in PACKAGES:
                    found.append(f"{path.relative_to(ROOT)}:{inner.lineno} imports {name} inside {node.name}()")
    return found


def test_no_project_import_inside_a_function():
    files = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    assert len(files) > 40  # the scan sees the whole tree
    found = [line for path in files for line in _function_level_project_imports(path)]
    assert found == []


def test_the_scan_finds_a_hidden_import(tmp_path):
    module = ROOT / "tasks" / "_scan_probe.py"
    try:
        module.write_text("def f():\n    from analysis import measure_overlap\n    return measure_overlap\n")
        assert _function_level_project_imports(module) == ["tasks/_scan_probe.py:2 imports analysis inside f()"]
    finally:
        module.unlink()


def test_import_linter_layers_contract_holds():
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout
