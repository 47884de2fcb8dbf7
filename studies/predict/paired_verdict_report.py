"""Writing the paired verdict (`mergecompose fit-verdict`): verdict.json, verdict.md, paired_rule.json and the plot of
every diagnostic against (best composition − best merge)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from mergecompose.analysis.paired_outcome import OUTCOMES
from mergecompose.core.io import atomic_save_figure, markdown_table
from mergecompose.experiments.compare_config import fingerprint
from mergecompose.experiments.run_folder import FolderLayout, RunFolder
from mergecompose.studies.predict.paired_verdict import (
    BASELINES,
    PREDICTIONS,
    LabelledSetting,
    fit_verdict,
    load_settings,
    usable_features,
)

GAP_PLOT = "diagnostics_vs_gap.png"
VERDICT_FOLDER = FolderLayout(
    "a fit-verdict folder",
    results="verdict.json",
    cached=(),
    owns=("verdict.json", "paired_rule.json", GAP_PLOT, "verdict.md"),
)
_COLOURS = {"merge": "tab:blue", "compose": "tab:red", "either": "tab:gray"}
_MARKERS = {"synthetic": "o", "real": "^"}


def run_fit_verdict(
    predict_dirs: Sequence[str | os.PathLike],
    real_dirs: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    overwrite: bool = False,
) -> dict:
    """Read the sweeps' folders, fit and score the rule without leaks, write the outputs; returns verdict.json."""
    sources = {"predict": [str(p) for p in predict_dirs], "real": [str(p) for p in real_dirs]}
    run = RunFolder(out_dir, VERDICT_FOLDER)
    run.check(fingerprint(sources), overwrite)  # the output first: refused before the sweeps are read
    settings = load_settings(predict_dirs, real_dirs)
    results = {"config_hash": fingerprint(sources), "sources": sources, **fit_verdict(settings)}
    with run.claim(results["config_hash"], overwrite):
        run.write_json("verdict.json", results, finite=True)
        run.write_json("paired_rule.json", results["rule"], finite=True)
        run.write_figure(GAP_PLOT, lambda path: plot_diagnostics_against_gap(settings, path))
        run.write_text("verdict.md", verdict_markdown(results))
    return results


def verdict_markdown(results: dict) -> str:
    """The held-out accuracy against the baselines (real settings, all settings), the confusion tables, the rows."""
    lines = [
        "# Merge or compose? The paired verdict, held out",
        "",
        f"{results['n_settings']} settings ({results['n_real']} real). Each is scored by a rule fitted without it and "
        "without every setting that shares an expert with it (a synthetic family shares its components). "
        "`undecided` counts as wrong.",
    ]
    for subset in ("real", "all"):
        report = results["heldout"][subset]
        lines += ["", f"## {'Real settings' if subset == 'real' else 'All settings'}", ""]
        rows = [["the rule", *_accuracy_cells(report["rule"])]]
        rows += [[name, *_accuracy_cells(report["baselines"][name])] for name in BASELINES]
        lines.append(markdown_table(["predictor", "held-out accuracy", "95 % interval", "right / n"], rows))
        beats = "beats" if report["beats_every_baseline"] else "does not beat"
        lines += ["", f"The rule {beats} every baseline here; {report['undecided']} undecided.", ""]
        lines.append(
            markdown_table(
                ["true \\ predicted", *PREDICTIONS],
                [[label, *(report["confusion"][label][p] for p in PREDICTIONS)] for label in OUTCOMES],
            )
        )
    lines += ["", "## Settings", ""]
    rows = [
        [
            row["name"],
            row["source"],
            row["label"],
            f"{100 * row['gap']:+.1f}",
            row["predicted"],
            row["baselines"]["majority"],
            row["fitted_on"],
            " / ".join(str(name) for name in row["reads"]),
        ]
        for row in results["rows"]
    ]
    header = ["setting", "source", "label", "compose − merge", "rule", "majority", "fitted on", "rule reads"]
    lines.append(markdown_table(header, rows))
    lines += ["", f"![every diagnostic against compose − merge]({GAP_PLOT})", ""]
    return "\n".join(lines)


def _accuracy_cells(entry: dict) -> list[str]:
    if entry["accuracy"] is None:
        return ["–", "–", "0 / 0"]
    low, high = entry["ci95"]
    return [
        f"{100 * entry['accuracy']:.1f} %",
        f"[{100 * low:.1f}, {100 * high:.1f}]",
        f"{entry['correct']} / {entry['n']}",
    ]


def plot_diagnostics_against_gap(settings: Sequence[LabelledSetting], path: Path) -> None:
    """One panel per usable diagnostic: its value against (best composition − best merge) on the test split, in
    points; colour: the label, marker: synthetic (o) or real (^)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = usable_features(settings) or [n for n in settings[0].diagnostics if n != "num_experts"]
    columns = min(6, len(names))
    rows = math.ceil(len(names) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 2.8 * rows), squeeze=False)
    for axis in axes.flat[len(names) :]:
        axis.set_visible(False)
    for axis, name in zip(axes.flat, names):
        for source, marker in _MARKERS.items():
            for label, colour in _COLOURS.items():
                members = [
                    s for s in settings if s.source == source and s.label == label and _defined(s.diagnostics.get(name))
                ]
                if members:
                    axis.scatter(
                        [s.diagnostics[name] for s in members],
                        [100 * s.gap for s in members],
                        color=colour,
                        marker=marker,
                        s=18,
                        label=f"{source}: {label}",
                    )
        axis.axhline(0, color="black", linewidth=0.5)
        axis.set_xlabel(name, fontsize=7)
        axis.set_ylabel("compose − merge, points", fontsize=7)
        axis.tick_params(labelsize=6)
        axis.grid(alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    for axis in axes.flat[1 : len(names)]:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    figure.legend(handles, labels, loc="upper right", fontsize=7)
    figure.suptitle("every diagnostic against (best composition − best merge) on the joint test split")
    figure.tight_layout(rect=(0, 0, 0.9, 0.97))
    try:
        atomic_save_figure(figure, path)
    finally:
        plt.close(figure)


def _defined(value) -> bool:
    return value is not None and math.isfinite(value)
