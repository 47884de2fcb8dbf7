"""Writing an overlap run: overlap.json, overlap.md, the activity heatmap and the gap histogram."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import yaml

from mergecompose.core.io import atomic_save_figure, markdown_table


def format_number(value, digits: int = 4) -> str:
    """A table cell: 4 significant digits, – for None."""
    if value is None:
        return "–"
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return str(value)
        return f"{value:.{digits}g}"
    return str(value)


def expert_rows(report: dict) -> list[list]:
    rows = []
    for name, stats in report["experts"].items():
        rows.append(
            [
                name,
                stats["kl_mean"],
                stats["kl_median"],
                stats["active_fraction"],
                stats["top1_shift_rate"],
                stats["sequences_active_fraction"],
                stats["interval_length_mean"],
                stats["projective_error"],
                stats["projective_error_active"],
                stats.get("linearization_error"),
            ]
        )
    return rows


EXPERT_HEADER = [
    "expert",
    "KL(p_i‖p_b) mean",
    "median ≤",
    "active frac.",
    "top-1 shift",
    "seqs active",
    "interval len.",
    "projective err.",
    "… where active",
    "lineariz. err.",
]
PAIR_HEADER = [
    "pair",
    "mass overlap O",
    "sign conflict",
    "support Jaccard",
    "norm ratio",
    "both shift top-1",
    "… to one token",
    "co-active",
    "interval overlap",
    "param. cosine",
    "TIES sign conflict",
    "trim-mask Jaccard",
]


def pair_rows(report: dict) -> list[list]:
    rows = []
    for key, stats in report["pairs"].items():
        parameter = stats.get("parameter") or {}
        rows.append(
            [
                key.replace("|", " + "),
                stats["mass_overlap"],
                stats["sign_conflict"],
                stats["support_jaccard"],
                stats["delta_norm_ratio"],
                stats["top1_both_shift_rate"],
                stats["top1_same_shift_share"],
                stats["coactivation_rate"],
                stats["interval_overlap_rate"],
                parameter.get("cosine"),
                parameter.get("ties_sign_conflict"),
                parameter.get("trimmed_mask_jaccard"),
            ]
        )
    return rows


def headline_rows(results: dict) -> list[list]:
    """One row per measured context: teacher-forced, then each rollout source."""
    contexts = [("teacher-forced", results)] + [(f"rollouts: {k}", v) for k, v in results.get("rollouts", {}).items()]
    contexts += [(f"{k}'s own prompts", v) for k, v in (results.get("expert_data") or {}).items()]
    rows = []
    for label, report in contexts:
        gap = report.get("merge_compose_gap") or {}
        rows.append(
            [
                label,
                report["num_positions"],
                report["coactivation_rate"],
                report["projective_error"]["single_active"],
                report["projective_error"]["single_active_fraction"],
                report["projective_error"]["dominant_shift"],
                gap.get("kl_mean"),
                gap.get("top1_agreement"),
            ]
        )
    return rows


HEADLINE_HEADER = [
    "measured on",
    "positions",
    "co-activation",
    "projective err. (|A|≤1)",
    "|A|≤1 frac.",
    "projective err. (one shifts top-1)",
    "gap KL(q‖m)",
    "top-1 agree",
]


def vocabulary_lines(results: dict) -> list[str]:
    """How the token statistics were measured: the centre, and the top-k union's outside mass and bounds."""
    settings = results["settings"]
    centre = settings.get("centre", "median").replace("_", " ")
    vocabulary = results.get("vocabulary")
    if not vocabulary:
        return [f"Deltas centred by the {centre}; every statistic over the whole vocabulary.", ""]
    outside = ", ".join(
        f"{name} {format_number(mean)} (max {format_number(vocabulary['outside_mass_max'][name])})"
        for name, mean in vocabulary["outside_mass_mean"].items()
    )
    bounds = "; ".join(
        f"{key} [{format_number(stats['mass_overlap_bounds'][0])}, {format_number(stats['mass_overlap_bounds'][1])}]"
        for key, stats in results["pairs"].items()
        if stats.get("mass_overlap_bounds")
    )
    return [
        f"Deltas centred by the {centre}. Centre, supports, overlap sums and top tokens on the "
        f"{vocabulary['candidates']} tokens each position's distributions rank highest "
        "(`--full-vocabulary` for all); "
        f"mean mass outside them: {outside}. "
        f"Mass overlap over the whole vocabulary lies in: {bounds or 'no bound for this centre'}.",
        "",
    ]


def markdown(results: dict) -> str:
    """The overlap.md report."""
    settings = results["settings"]
    lines = [
        "# Overlap of expert logit deltas, projectivity, merge ≈ compose",
        "",
        f"Activity threshold ε = {settings['epsilon']} nats, support floor η = {settings['eta']}.",
        "",
        *vocabulary_lines(results),
        "## Headline",
        "",
        *markdown_table(HEADLINE_HEADER, headline_rows(results), cell=format_number).splitlines(),
        "",
        "Co-activation by ε (teacher-forced): "
        + ", ".join(f"ε={e}: {format_number(v)}" for e, v in results["coactivation_by_epsilon"].items()),
        "",
        "## Experts (teacher-forced)",
        "",
        *markdown_table(EXPERT_HEADER, expert_rows(results), cell=format_number).splitlines(),
        "",
        "## Pairs (teacher-forced)",
        "",
        *markdown_table(PAIR_HEADER, pair_rows(results), cell=format_number).splitlines(),
        "",
    ]
    gap = results.get("merge_compose_gap")
    if gap:
        lines += [
            "## Merge vs compose",
            "",
            f"KL(q‖m): mean {format_number(gap['kl_mean'])}, p95 ≤ {format_number(gap['kl_p95'])}, "
            f"max {format_number(gap['kl_max'])}; "
            f"top-1 agreement {format_number(gap['top1_agreement'])}.",
        ]
        if "interaction_residual_rms" in gap:
            lines.append(
                f"Interaction residual on centred logits: RMS {format_number(gap['interaction_residual_rms'])}, "
                f"relative to the composed logit change {format_number(gap['interaction_residual_relative'])}."
            )
        lines.append("")
    lines += retention_lines(results)
    for name, report in (results.get("expert_data") or {}).items():
        lines += retention_lines(report, f"{name} on its own prompts (its greedy outputs)", only=name)
    lines += interference_lines(results)
    lines += ["## Tokens each expert moves most (mean |δ̃|)", ""]
    for name, stats in results["experts"].items():
        tokens = ", ".join(f"{t['token']!r} {t['mean_abs_delta']:.3g}" for t in stats["top_tokens"])
        lines.append(f"- **{name}**: {tokens}")
    lines += ["", "## Example positions (reservoir sample)", ""]
    for example in results["reservoir"][:8]:
        context = "".join(str(t) for t in example.get("context", []))
        activity = ", ".join(format_number(a, 3) for a in example["activity"])
        tops = "; ".join(
            f"{name}: {' '.join(repr(str(t)) for t, _ in top[:3])}" for name, top in example["top"].items()
        )
        lines.append(f"- `{context!r}` → {example.get('next_token', '')!r}; activity [{activity}]; top-3 {tops}")
    lines.append("")
    if "recommendation" in results:
        lines += ["## Merge or compose?", "", "```", recommendation_text(results["recommendation"]), "```", ""]
    return "\n".join(lines)


RETENTION_HEADER = [
    "expert",
    "positions shifted",
    "merge KL(p_i‖m)",
    "merge keeps",
    "compose KL(p_i‖q)",
    "compose keeps",
    "base log p_b(t_i)",
]


def retention_lines(results: dict, where: str = "teacher-forced", only: str | None = None) -> list[str]:
    """Which of the merge and the composition keeps each expert's top-1 decisions (`analysis.retention`), measured
    `where`: every expert's row, or `only` that expert's."""
    retention = results.get("retention")
    if not retention:
        return []
    rows = []
    for name, stats in results["experts"].items():
        if only is not None and name != only:
            continue
        kept = stats.get("retention") or {}
        merge, compose = kept.get("merge") or {}, kept.get("compose") or {}
        rows.append(
            [
                name,
                retention["shifted_positions"][name],
                merge.get("kl_mean"),
                merge.get("kept_share"),
                compose.get("kl_mean"),
                compose.get("kept_share"),
                stats.get("base_logprob_mean"),
            ]
        )
    return [
        f"## Which side keeps each expert's decisions ({where})",
        "",
        "Where expert i's top-1 token differs from the base's: how far the merge and the composition are from it, "
        "and the share of those positions where each keeps its token.",
        "",
        *markdown_table(RETENTION_HEADER, rows, cell=format_number).splitlines(),
        "",
    ]


def interference_lines(results: dict) -> list[str]:
    """Input-space interference of LoRA experts (`analysis.input_interference`), or why there is none."""
    if "input_interference" not in results:
        return []
    interference = results["input_interference"]
    lines = ["## Input-space interference (LoRA experts, teacher-forced)", ""]
    if interference is None:
        return [*lines, "Not measured: the experts are not all LoRA adapters.", ""]
    rows = [[pair, values["mean"], values["max"]] for pair, values in interference["pairs"].items()]
    return [
        *lines,
        "ρ(i→j) = ‖ΔW_j H_i‖ / ‖ΔW_i H_i‖ per adapted layer, H_i the layer's inputs in expert i's model: how much "
        f"expert j's update answers expert i's inputs. Over {len(interference['layers'])} layers and both "
        f"directions: mean {format_number(interference['mean'])}, max {format_number(interference['max'])}.",
        "",
        *markdown_table(["i→j", "mean over layers", "max over layers"], rows, cell=format_number).splitlines(),
        "",
    ]


def terminal_table(results: dict) -> str:
    """The headline, expert and pair tables as plain text."""
    blocks = []
    for header, rows in [
        (HEADLINE_HEADER, headline_rows(results)),
        (EXPERT_HEADER, expert_rows(results)),
        (PAIR_HEADER, pair_rows(results)),
    ]:
        blocks.append(markdown_table(header, rows, cell=format_number, pad=True))
    return "\n\n".join(blocks)


def plot_activity_heatmap(
    heatmap: list[dict],
    expert_names: list[str],
    path: Path,
    intervals_label: str = "estimated active interval [τ1, τ2)",
) -> None:
    """Per-position activity log10 KL(p_i ‖ p_b) of a few sequences, one panel per sequence.

    `intervals_label` says what the cyan boxes (each item's `intervals`) are."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Rectangle

    panels = max(len(heatmap), 1)
    width = max([len(item["activity"][0]) for item in heatmap] + [8])
    height = 0.8 + (0.35 * len(expert_names) + 0.7) * panels
    figure, axes = plt.subplots(
        panels, 1, figsize=(min(2.5 + 0.25 * width, 30), height), squeeze=False, layout="constrained"
    )
    figure.suptitle(
        "activity log10 KL(p_i ‖ p_b) per position; x label: the token the position predicts;\n"
        f"cyan: {intervals_label}",
        fontsize=9,
    )
    image = None
    for axis, item in zip(axes[:, 0], heatmap):
        values = np.log10(np.asarray(item["activity"], dtype=float) + 1e-6)  # (k, n)
        image = axis.imshow(values, aspect="auto", cmap="magma", vmin=-4, vmax=1, interpolation="nearest")
        axis.set_yticks(range(len(expert_names)), expert_names, fontsize=7)
        # The estimated active interval [τ1, τ2) of each expert, outlined.
        for index, interval in enumerate(item.get("intervals") or []):
            if interval is not None:
                axis.add_patch(
                    Rectangle(
                        (interval[0] - 0.5, index - 0.5),
                        interval[1] - interval[0],
                        1,
                        fill=False,
                        edgecolor="cyan",
                        linewidth=1.2,
                    )
                )
        tokens = item.get("next_tokens")
        if tokens and len(tokens) <= 80:
            axis.set_xticks(range(len(tokens)), [repr(str(t))[1:-1].replace(" ", "␣") for t in tokens], fontsize=6)
        axis.set_title(f"sequence {item['sequence']}", fontsize=8, loc="left")
    if not heatmap:
        axes[0, 0].text(0.5, 0.5, "no sequences", ha="center")
    if image is not None:
        figure.colorbar(image, ax=axes[:, 0].tolist(), label="log10 KL(p_i ‖ p_b)")
    try:
        atomic_save_figure(figure, path)
    finally:
        plt.close(figure)


def plot_gap_histogram(histogram: dict, path: Path, title: str = "merge-vs-compose gap KL(q ‖ m) per position") -> None:
    """Counts of KL(q ‖ m) in log-spaced bins; the first bar is [0, lowest edge)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    inner = np.asarray(histogram["edges"], dtype=float)
    counts = np.asarray(histogram["counts"], dtype=float)
    # Draw the open-ended first and last bins one decade wide.
    edges = np.concatenate([[inner[0] / 10], inner, [inner[-1] * 10]])
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.stairs(counts, edges, fill=True)
    axis.set_xscale("log")
    axis.set_xlabel(f"KL (nats); first bin: [0, {inner[0]:.0e}), last: [{inner[-1]:.0e}, ∞]")
    axis.set_ylabel("positions")
    axis.set_title(title, fontsize=9)
    try:
        atomic_save_figure(figure, path, bbox_inches="tight")
    finally:
        plt.close(figure)


def json_safe(value, undefined: list[str] | None = None, path: str = ""):
    """What JSON cannot hold, replaced: ±inf by the strings "inf" / "-inf", NaN (an undefined value) by
    null, with its key path appended to `undefined` when a list is given; tuples by lists."""
    if isinstance(value, float) and math.isnan(value):
        if undefined is not None:
            undefined.append(path or "(top level)")
        return None
    if isinstance(value, float) and math.isinf(value):
        return str(value)
    if isinstance(value, dict):
        return {
            str(key): json_safe(item, undefined, f"{path}.{key}" if path else str(key)) for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [json_safe(item, undefined, f"{path}[{index}]") for index, item in enumerate(value)]
    return value


def json_text(results: dict, name: str) -> str:
    """`results` as JSON text for the file `name`; a NaN is written as null, with a warning naming its keys
    (`allow_nan=False`: a bare NaN, which is not JSON, can never be written)."""
    undefined: list[str] = []
    text = json.dumps(json_safe(results, undefined), indent=1, allow_nan=False)
    if undefined:
        warnings.warn(
            f"{name}: {len(undefined)} values were NaN (undefined) and are written as null: {', '.join(undefined[:8])}"
            + (" ..." if len(undefined) > 8 else ""),
            UserWarning,
            stacklevel=2,
        )
    return text


def write_outputs(folder: Path, results: dict, config: dict) -> list[str]:
    """Write every output of an overlap run into `folder`; return the file names."""
    folder = Path(folder)
    (folder / "overlap.json").write_text(json_text(results, "overlap.json"))
    (folder / "overlap.md").write_text(markdown(results))
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    names = ["overlap.json", "overlap.md", "config.yaml", "activity_heatmap.png"]
    plot_activity_heatmap(results["heatmap"], list(results["experts"]), folder / "activity_heatmap.png")
    if results.get("merge_compose_gap"):
        plot_gap_histogram(results["merge_compose_gap"]["histogram"], folder / "gap_histogram.png")
        names.append("gap_histogram.png")
    return names


def _percent(value: float) -> str:
    return f"{100 * value:.0f} %"


def _interval(interval) -> str:
    low, high = interval
    return f"[{_percent(low)}, {_percent(high)}]"


_MEASURE_IT = "Measure it: `mergecompose decide` (docs/guides/merge-or-compose.md)."


def _real_settings_lines(recommendation: dict) -> tuple[str | None, str]:
    """The "no recommendation" headline (None where the verdict is a decision) and the line of the rule's figures
    on real experts (`RealSettingsScore`), or that it has none."""
    real = recommendation.get("real_settings")
    if real is None:
        headline = (
            "No recommendation: this rule was not measured on real experts, so its verdict is not a decision. "
            + _MEASURE_IT
        )
        return headline, "  not measured on real experts: the rule file has no figures on real settings"
    constant = real["best_constant"]
    rates = ", ".join(f"{label} {_percent(rate)}" for label, rate in real["base_rates"].items())
    figures = (
        f"  on real experts (held out from the rule): {_percent(real['accuracy'])} {_interval(real['interval'])} "
        f"right over {real['n']} settings ({real['undecided']} undecided); always answering "
        f"{constant['label']!r}: {_percent(constant['accuracy'])} {_interval(constant['interval'])}; "
        f"base rates: {rates} ({real['source']})"
    )
    if recommendation.get("decision"):
        return None, figures
    headline = (
        "No recommendation: on real experts these diagnostics do not predict merge or compose better than always "
        f"answering {constant['label']!r} (rule {_percent(real['accuracy'])} {_interval(real['interval'])} vs "
        f"{_percent(constant['accuracy'])}, {real['n']} settings); base rates: {rates}. {_MEASURE_IT}"
    )
    return headline, figures


def recommendation_text(recommendation: dict) -> str:
    """`--recommend`'s verdict with its evidence, as lines for the terminal and overlap.md.

    The verdict is a decision only where the rule beats the best constant answer on real experts
    (`recommendation["decision"]`); otherwise the first line says there is no recommendation and why, and the
    verdict follows as what the rule would say."""
    accuracy = recommendation["heldout_accuracy"]
    sweep = recommendation.get("sweep") or {}
    verdict = recommendation["verdict"]
    possible = recommendation.get("possible_verdicts") or [verdict]
    undefined = recommendation.get("undefined") or {}
    if len(possible) > 1:
        verdict += f" (one of {', '.join(possible)}: a diagnostic the rule reads is undefined here)"
    elif undefined:
        verdict += " (a diagnostic the rule reads is undefined here; the verdict does not depend on it)"
    headline, figures = _real_settings_lines(recommendation)
    first = [f"Recommendation: {verdict}"]
    if headline is not None:
        first = [headline, f"  what the rule would say (not a decision): {verdict}"]
    lines = [
        *first,
        *(f"  undefined: {name}: {reason}" for name, reason in undefined.items()),
        *(f"  {name}: {text}" for name, text in recommendation["evidence"].items()),
        figures,
        f"  the rule's accuracy on held-out synthetic task families: {format_number(accuracy)} "
        f"over {recommendation['n_settings']} settings "
        f"(sweep {sweep.get('name', '?')}, version {sweep.get('version', '?')})",
        f"  note: {recommendation['caveat']}",
    ]
    return "\n".join(lines)
