"""Across-pair statistics of the sweep: Spearman correlation and the 2×2 table, by hand."""

from __future__ import annotations

import pytest

from mergecompose.studies.letters.overlap_sweep_stats import plot_overlap_against_error, spearman, two_by_two


def test_spearman_golden_and_edge_cases():
    rows = [{"x": x, "y": y} for x, y in [(1, 1), (2, 3), (3, 2), (4, 4)]]
    # ρ = 1 − 6 Σd² / (n(n² − 1)) = 1 − 6·2 / 60 = 0.8
    assert spearman(rows, "x", "y")["rho"] == pytest.approx(0.8)
    assert spearman([{"x": i, "y": -i * i} for i in range(5)], "x", "y")["rho"] == pytest.approx(-1.0)
    # Missing values are left out; too few rows or a constant column give None.
    assert spearman(rows + [{"x": 5, "y": None}], "x", "y")["n"] == 4
    assert spearman(rows[:2], "x", "y")["rho"] is None
    assert spearman([{"x": 1, "y": i} for i in range(4)], "x", "y")["rho"] is None


def test_two_by_two_golden():
    rows = [
        {"pair": "ab+cd", "overlap": 0.0, "lin": 0.01, "compose": 1.0, "merge": 0.95},
        {"pair": "ab+ef", "overlap": 0.1, "lin": 0.5, "compose": 0.99, "merge": 0.2},
        {"pair": "ab+ac", "overlap": 0.9, "lin": 0.02, "compose": 0.0, "merge": 0.5},
        {"pair": "ab+bc", "overlap": 0.7, "lin": 0.9, "compose": 0.3, "merge": 0.0},
    ]
    table = two_by_two(rows, "overlap", "lin", "compose", "merge", success_threshold=0.9)
    assert table["overlap_split"] == pytest.approx(0.4) and table["linearization_split"] == pytest.approx(0.26)
    cells = table["cells"]
    assert cells["overlap low, linearization low"] == {
        "n": 1,
        "pairs": ["ab+cd"],
        "compose_success": 1.0,
        "merge_success": 1.0,
        "compose_accuracy_mean": 1.0,
        "merge_accuracy_mean": 0.95,
    }
    assert cells["overlap low, linearization high"]["merge_success"] == 0.0
    assert cells["overlap high, linearization low"]["pairs"] == ["ab+ac"]
    assert cells["overlap high, linearization high"]["compose_success"] == 0.0
    empty = two_by_two(rows[:1], "overlap", "lin", "compose", "merge", 0.9, overlap_split=0.5, linearization_split=0.5)
    assert empty["cells"]["overlap high, linearization high"]["compose_success"] is None
    with pytest.raises(ValueError, match="`success_threshold`"):
        two_by_two(rows, "overlap", "lin", "compose", "merge", success_threshold=90)


def test_scatter_plot_is_written(tmp_path):
    rows = [{"pair": f"p{i}", "overlap": i / 10, "compose_error": i / 20, "merge_error": 1 - i / 10} for i in range(5)]
    path = tmp_path / "scatter.png"
    plot_overlap_against_error(rows, "overlap", {"compose": "compose_error", "merge": "merge_error"}, path, "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
