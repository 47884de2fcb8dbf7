"""Across expert pairs: does output-space overlap predict composition error, and linearity merge error?

Each row is one expert pair with its measured overlap, linearization error and the joint-task
errors of the composition and of the best merge. Pure functions on lists of dicts; scipy
computes the rank correlation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from scipy.stats import spearmanr

from mergecompose.core.io import atomic_save_figure


def spearman(rows: Sequence[Mapping], x_key: str, y_key: str) -> dict:
    """Spearman's rank correlation ρ between `row[x_key]` and `row[y_key]` (ties get average ranks).

    Rows with a missing or non-finite value are left out. Returns `{"rho", "p_value", "n"}`;
    ρ is None (not NaN) when fewer than 3 rows remain or either column is constant.
    """
    pairs = [
        (float(row[x_key]), float(row[y_key]))
        for row in rows
        if row.get(x_key) is not None
        and row.get(y_key) is not None
        and math.isfinite(float(row[x_key]))
        and math.isfinite(float(row[y_key]))
    ]
    n = len(pairs)
    if n < 3 or len({x for x, _ in pairs}) < 2 or len({y for _, y in pairs}) < 2:
        return {"rho": None, "p_value": None, "n": n}
    result = spearmanr([x for x, _ in pairs], [y for _, y in pairs])
    return {"rho": float(result.statistic), "p_value": float(result.pvalue), "n": n}


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else 0.5 * (ordered[middle - 1] + ordered[middle])


def two_by_two(
    rows: Sequence[Mapping],
    overlap_key: str,
    linearization_key: str,
    compose_success_key: str,
    merge_success_key: str,
    success_threshold: float,
    overlap_split: float | None = None,
    linearization_split: float | None = None,
) -> dict:
    """Pairs split into overlap low/high × linearization error low/high, with their success rates.

    A value is "high" when it is strictly above the split, which defaults to the median over
    the rows (so each side holds about half the pairs). A pair succeeds when its joint-task
    accuracy `row[*_success_key]` is ≥ `success_threshold`.

    Returns `{"overlap_split", "linearization_split", "cells": {"overlap low, linearization low":
    {"n", "pairs", "compose_success", "merge_success", "compose_accuracy_mean",
    "merge_accuracy_mean"}, ...}}`; rates are None in an empty cell.
    """
    if not 0 <= success_threshold <= 1:
        raise ValueError(f"`success_threshold` must be in [0, 1], got {success_threshold}")
    if not rows:
        raise ValueError("`rows` is empty; the 2×2 table needs at least one pair")
    overlap_split = median([r[overlap_key] for r in rows]) if overlap_split is None else overlap_split
    linearization_split = (
        median([r[linearization_key] for r in rows]) if linearization_split is None else linearization_split
    )
    cells = {}
    for overlap_high in (False, True):
        for linear_high in (False, True):
            members = [
                r
                for r in rows
                if (r[overlap_key] > overlap_split) == overlap_high
                and (r[linearization_key] > linearization_split) == linear_high
            ]
            label = f"overlap {'high' if overlap_high else 'low'}, linearization {'high' if linear_high else 'low'}"
            cell = {"n": len(members), "pairs": [r["pair"] for r in members]}
            for kind, key in (("compose", compose_success_key), ("merge", merge_success_key)):
                accuracies = [r[key] for r in members]
                cell[f"{kind}_success"] = (
                    sum(a >= success_threshold for a in accuracies) / len(members) if members else None
                )
                cell[f"{kind}_accuracy_mean"] = sum(accuracies) / len(members) if members else None
            cells[label] = cell
    return {
        "overlap_split": overlap_split,
        "linearization_split": linearization_split,
        "success_threshold": success_threshold,
        "cells": cells,
    }


def plot_overlap_against_error(
    rows: Sequence[Mapping], x_key: str, y_keys: Mapping[str, str], path, title: str
) -> None:
    """Scatter of `row[x_key]` against each `row[y_key]` (one colour per label), names on the points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.5, 4.5))
    for label, key in y_keys.items():
        xs = [r[x_key] for r in rows]
        ys = [r[key] for r in rows]
        axis.scatter(xs, ys, label=label, alpha=0.8)
        for x, y, row in zip(xs, ys, rows):
            axis.annotate(row["pair"], (x, y), fontsize=6, alpha=0.7, xytext=(2, 2), textcoords="offset points")
    axis.set_xlabel(x_key)
    axis.set_ylabel("joint-task error (1 − exact match)")
    axis.set_title(title, fontsize=9)
    axis.legend(fontsize=8)
    try:
        atomic_save_figure(figure, path, bbox_inches="tight")
    finally:
        plt.close(figure)
