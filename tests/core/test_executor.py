"""The cells of a run and the local executor (mergecompose.core.executor): order, failures, dependents."""

from __future__ import annotations

import os

import pytest

from mergecompose.core.executor import Cell, CellsFailed, LocalExecutor, raise_if_failed, run_cells


def _fails(message):
    raise RuntimeError(message)


def test_local_cells_run_in_order_here_and_a_failure_stops_only_its_dependents():
    order = []
    cells = [
        Cell("a", order.append, ("a",)),
        Cell("b", _fails, ("broken\non two lines",)),
        Cell("c", order.append, ("c",), after=("a",)),
        Cell("d", order.append, ("d",), after=("b",)),
    ]
    runs = run_cells(cells, LocalExecutor(), progress=False)
    assert order == ["a", "c"]
    assert [run.ok for run in runs.values()] == [True, False, True, False]
    assert runs["b"].error == "RuntimeError: broken on two lines" and "Traceback" in runs["b"].details
    assert runs["d"].error == "not run: b failed"
    assert runs["a"].where["pid"] == os.getpid() and runs["a"].where["seconds"] >= 0
    with pytest.raises(CellsFailed, match=r"2 cell\(s\) failed .* b: RuntimeError: broken on two lines; d: not run"):
        raise_if_failed(runs)


@pytest.mark.parametrize(
    ("cells", "message"),
    [
        ([Cell("a", int), Cell("a", int)], "cell names must be unique"),
        ([Cell("a", int, after=("b",)), Cell("b", int)], "cell 'a' waits for 'b', which is not an earlier cell"),
    ],
)
def test_a_bad_list_of_cells_is_refused_before_any_runs(cells, message):
    with pytest.raises(ValueError, match=message):
        run_cells(cells, progress=False)
