"""The results of a `type: lm_eval` compare as tables (terminal and results.md) and a bar chart (systems × tasks)."""

from __future__ import annotations

from pathlib import Path

from mergecompose.core.io import atomic_save_figure, markdown_table

PAPER_DEFINITIONS = "the papers’ definitions, mergecompose.merging.merge"


def _cell(record: dict | None) -> str:
    if record is None:
        return "–"
    text = f"{100 * record['value']:.1f}"
    if record["ci95"] is not None:
        low, high = record["ci95"]
        text += f" [{100 * low:.1f}, {100 * high:.1f}]"
    return text


def splits(results: dict) -> list[str]:
    """Every split (`<task>/<metric>`) of any system, in the order first seen."""
    return list(dict.fromkeys(split for record in results["systems"].values() for split in record["splits"]))


def results_table(results: dict) -> str:
    """Systems × splits: value % [95 % interval], with each split's n."""
    columns = splits(results)
    sizes = {}
    for record in results["systems"].values():
        for split, cell in record["splits"].items():
            sizes.setdefault(split, cell["n"])
    header = ["system", *[f"{split} (n={sizes[split]})" for split in columns]]
    rows = [
        [name, *[_cell(record["splits"].get(split)) for split in columns]]
        for name, record in results["systems"].items()
    ]
    return markdown_table(header, rows, pad=True)


def results_markdown(results: dict) -> str:
    config = results["config"]
    parts = [
        f"# {config['name']}: merging and composition on lm-eval tasks",
        "",
        "Each cell: lm-eval's metric in % with a 95 % interval (Wilson's for 0/1 metrics, else ±1.96 · lm-eval's "
        "stderr). Base, experts and merges are lm-eval's `hf` model, compositions its `composed` model.",
        "",
        results_table(results),
        "",
        "![systems × tasks](bars.png)",
        "",
    ]
    if results["merges"]:
        definitions = results["config"].get("merge_definitions", "mergekit")
        parts += [
            f"## Merges ({'mergekit' if definitions == 'mergekit' else PAPER_DEFINITIONS})",
            "",
        ]
        rows = []
        for method, record in results["merges"].items():
            tried = ", ".join(
                f"{entry['params']}: {100 * entry['score']:.1f}" for entry in record.get("validation", [])
            )
            rows.append([method, str(record["chosen"]), tried or "– (one point)"])
        parts += [markdown_table(["method", "chosen", "validation (selection task)"], rows), ""]
    parts += [
        "## Per-sample logs",
        "",
        "lm-eval's per-sample logs (prompt, response, target, metrics) are in `samples/<system>/<task>.jsonl`.",
        "",
        "## Cells",
        "",
        f"Evaluated in this run: {len(results['cells']['evaluated'])}; reused from an earlier run: "
        f"{len(results['cells']['reused'])}.",
        "",
        "## Timings (seconds)",
        "",
        ", ".join(f"{key}: {value}" for key, value in results["timings"].items()),
        "",
    ]
    return "\n".join(parts)


def plot_bars(results: dict, path: Path) -> None:
    """One group of bars per split, one bar per system, with the 95 % intervals as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = splits(results)
    systems = list(results["systems"])
    width = 0.8 / max(1, len(systems))
    figure, axis = plt.subplots(figsize=(max(6.0, 1.2 + 0.35 * len(systems) * len(columns)), 4.0))
    colours = plt.get_cmap("tab20").colors
    for index, name in enumerate(systems):
        cells = [results["systems"][name]["splits"].get(split) for split in columns]
        xs = [column + (index - (len(systems) - 1) / 2) * width for column in range(len(columns))]
        values = [100 * cell["value"] if cell else 0.0 for cell in cells]
        errors = [
            [100 * (cell["value"] - cell["ci95"][0]) if cell and cell["ci95"] else 0.0 for cell in cells],
            [100 * (cell["ci95"][1] - cell["value"]) if cell and cell["ci95"] else 0.0 for cell in cells],
        ]
        axis.bar(xs, values, width, yerr=errors, capsize=2, color=colours[index % len(colours)], label=name)
    axis.set_xticks(range(len(columns)))
    axis.set_xticklabels(columns, rotation=15, ha="right", fontsize=8)
    axis.set_ylabel("% (95 % interval)")
    axis.set_title(f"{results['config']['name']}: systems × tasks", fontsize=10)
    axis.grid(axis="y", alpha=0.3)
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    try:
        atomic_save_figure(figure, path)
    finally:
        plt.close(figure)
