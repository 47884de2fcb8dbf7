"""Writing a predict-sweep: predict.json, predict.md, predict_rule.json, config.yaml and the scatter plots."""

from __future__ import annotations

import functools
from pathlib import Path

from mergecompose.analysis.overlap_report import format_number
from mergecompose.analysis.predict import VERDICTS
from mergecompose.core.io import atomic_save_figure, markdown_table
from mergecompose.experiments.run_folder import RunFolder

SCATTERS = {"compose_error": "scatter_compose_error.png", "merge_error": "scatter_merge_error.png"}
_KEY_OF = {"compose_error": "spearman_compose_error", "merge_error": "spearman_merge_error"}


def write_outputs(run: RunFolder, results: dict, config) -> list[str]:
    """predict.json, predict.md, config.yaml, predict_rule.json (where a rule was fitted) and the scatter plots
    into the run folder; returns the names written."""
    written = ["predict.json", "predict.md", "config.yaml"]
    run.write_json("predict.json", results, finite=True)
    run.write_text("predict.md", predict_markdown(results))
    run.write_config(config, allow_unicode=True)
    if results["rule"] is not None:
        rule = {
            **results["rule"],
            "heldout_accuracy": results["verdict"]["heldout_accuracy"],
            "sweep": {"name": results["name"], "version": results["version"], "config_hash": results["config_hash"]},
        }
        run.write_json("predict_rule.json", rule, finite=True)
        written.append("predict_rule.json")
    for outcome, file in SCATTERS.items():
        top = ranked(results, _KEY_OF[outcome])[:3]
        if top:
            run.write_figure(file, functools.partial(plot_scatter, results["settings"], top, outcome, results=results))
            written.append(file)
    return written


def ranked(results: dict, key: str) -> list[str]:
    """Diagnostics by decreasing |ρ| for `key` (those with a defined ρ)."""
    table = results["diagnostics"]
    names = [n for n in table if table[n][key]["rho"] is not None]
    return sorted(names, key=lambda n: -abs(table[n][key]["rho"]))


def _percent(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def _paired(record: dict) -> str:
    paired = record.get("paired")
    return "–" if paired is None else f"{paired['label']} ({paired['composition']}, p = {paired['p_value']:.2g})"


def _cell(entry: dict) -> str:
    if entry["rho"] is None:
        return "undefined"
    interval = entry["ci95"]
    shown = f"{entry['rho']:+.2f}"
    if interval:
        shown += f" [{interval[0]:+.2f}, {interval[1]:+.2f}]"
    return shown


def predict_markdown(results: dict) -> str:
    settings = results["settings"]
    top = ranked(results, "spearman_compose_error")[:4]
    lines = [
        f"# Merge or compose? `{results['name']}` (sweep version {results['version']})",
        "",
        f"{len(settings)} settings in {len({s['family'] for s in settings})} families; "
        f"this run {results['seconds']} s. "
        f"Measuring the settings took {results['setting_seconds']} s in all "
        "(a setting measured by an earlier run counts "
        "the time it took then); training the components is not included.",
        "",
        "## Settings: exact match % (a system succeeds at ≥ "
        f"{100 * (results['rule'] or {}).get('success_threshold', 0.9):.0f} %) "
        "and the diagnostics most correlated with composition error",
        "",
    ]
    header = [
        "setting",
        "family",
        "k",
        "experts",
        "compose",
        "best remedy",
        "best merge",
        "weakest expert",
        "verdict",
        "paired label (composition chosen on validation)",
        *top,
    ]
    rows = []
    for record, verdict in zip(settings, results["verdict"]["truth"]):
        outcomes = record["outcomes"]
        rows.append(
            [
                record["name"],
                record["family"],
                len(record["experts"]),
                record["experts_kind"],
                _percent(outcomes["compose"]),
                f"{_percent(outcomes['best_remedy'])} ({record['best_remedy_name']})",
                f"{_percent(outcomes['best_merge'])} ({record['merge_chosen']['method']})",
                _percent(min(outcomes["experts"].values())),
                verdict,
                _paired(record),
                *[record["diagnostics"][name] for name in top],
            ]
        )
    lines += markdown_table(header, rows, cell=format_number).splitlines()
    lines += [
        "",
        "## Spearman ρ [95 % bootstrap interval] of each unlabelled diagnostic, across settings",
        "",
        "Against composition error, best-merge error, and the gap (composition − merge accuracy); and the partial ρ "
        "against composition error with the weakest expert's own accuracy partialled out. "
        "Sorted by |ρ| against composition error.",
        "",
    ]
    table = results["diagnostics"]
    rows = [
        [
            name,
            _cell(table[name]["spearman_compose_error"]),
            format_number(table[name]["spearman_compose_error"]["p"]),
            _cell(table[name]["spearman_merge_error"]),
            _cell(table[name]["spearman_gap"]),
            _cell(table[name]["partial_compose_error"]),
        ]
        for name in ranked(results, "spearman_compose_error")
    ]
    lines += markdown_table(
        ["diagnostic", "ρ compose error", "p", "ρ merge error", "ρ gap", "partial ρ compose error"], rows
    ).splitlines()
    lines += ["", "## Best", ""]
    for key, entry in results["best"].items():
        lines.append(f"- {key}: **{entry['diagnostic']}**, {_cell(entry)}, p = {format_number(entry['p'])}")
    combination = results.get("combination")
    if combination:
        lines.append(
            f"- two-diagnostic combination (sum of signed ranks, chosen in-sample) against composition error: "
            f"**{' + '.join(combination['features'])}**, {_cell(combination)}"
        )
    lines.append(f"- target ({results['target']['rule']}): {'met' if results['target']['met'] else 'not met'}")
    verdict = results["verdict"]
    lines += [
        "",
        "## The verdict rule, validated leave-one-family-out",
        "",
        f"Held-out accuracy: {format_number(verdict['heldout_accuracy'])} over {verdict['n_settings']} settings.",
        "",
    ]
    lines += markdown_table(
        ["family", "held-out accuracy", "n"],
        [[f, v["accuracy"], v["n"]] for f, v in verdict["per_family"].items()],
        cell=format_number,
    ).splitlines()
    lines += ["", "Confusion (rows: true verdict, columns: predicted):", ""]
    lines += markdown_table(
        ["true \\ predicted", *VERDICTS], [[t, *[verdict["confusion"][t][p] for p in VERDICTS]] for t in VERDICTS]
    ).splitlines()
    rule = results["rule"]
    if rule:
        lines += ["", "Rule fitted on every setting (shipped as predict_rule.json):", ""]
        for name in ("compose", "merge", "remedy"):
            threshold = rule[name]
            if threshold["feature"] is None:
                lines.append(f"- {name}: constant {'success' if threshold['constant'] else 'failure'}")
            else:
                sign = "≥" if threshold["direction"] == "above" else "<"
                lines.append(
                    f"- {name} succeeds when {threshold['feature']} {sign} {threshold['threshold']:.4g} "
                    f"(training accuracy {threshold['training_accuracy']:.3f})"
                )
    lines += ["", "![composition error](scatter_compose_error.png)", "", "![merge error](scatter_merge_error.png)", ""]
    return "\n".join(lines)


def plot_scatter(settings: list[dict], names: list[str], outcome: str, path: Path, results: dict) -> None:
    """One panel per diagnostic: the diagnostic against `outcome` per setting, coloured by family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = list(dict.fromkeys(s["family"] for s in settings))
    colours = plt.get_cmap("tab10").colors
    figure, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 4), squeeze=False)
    for axis, name in zip(axes[0], names):
        for index, family in enumerate(families):
            members = [s for s in settings if s["family"] == family]
            y = [1 - s["outcomes"]["compose" if outcome == "compose_error" else "best_merge"] for s in members]
            axis.scatter(
                [s["diagnostics"][name] for s in members],
                [100 * v for v in y],
                color=colours[index % len(colours)],
                label=family,
                s=22,
            )
        entry = results["diagnostics"][name][_KEY_OF[outcome]]
        axis.set_title(f"ρ = {_cell(entry)}", fontsize=9)
        axis.set_xlabel(name)
        axis.set_ylabel(f"{outcome.replace('_', ' ')} %")
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    figure.suptitle(f"{outcome.replace('_', ' ')} against the best unlabelled diagnostics")
    figure.tight_layout()
    try:
        atomic_save_figure(figure, path)
    finally:
        plt.close(figure)
