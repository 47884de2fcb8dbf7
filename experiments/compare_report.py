"""The results as tables (terminal and results.md) and the accuracy-against-length plot."""

from __future__ import annotations

from pathlib import Path

from mergecompose.core.io import atomic_save_figure, markdown_table


def _percent(value: float) -> str:
    return f"{100 * value:.1f}"


def _cell(record: dict) -> str:
    low, high = record["ci95"]
    return f"{_percent(record['exact_match'])} [{_percent(low)}, {_percent(high)}]"


def splits_table(results: dict) -> str:
    """Systems × test splits: exact match % [95 % CI], scored against the joint target."""
    systems = results["systems"]
    splits = list(next(iter(systems.values()))["splits"])
    sizes = {split: next(iter(systems.values()))["splits"][split]["n"] for split in splits}
    header = ["system", *[f"{split} (n={sizes[split]})" for split in splits]]
    rows = [[name, *[_cell(record["splits"][split]) for split in splits]] for name, record in systems.items()]
    return markdown_table(header, rows, pad=True)


def length_table(results: dict) -> str:
    """Systems × lengths: exact match % on each system's own target."""
    systems = results["systems"]
    lengths = list(next(iter(systems.values()))["by_length"])
    header = ["system", "own target", *lengths]
    rows = [
        [name, record["target"], *[_percent(record["by_length"][length]) for length in lengths]]
        for name, record in systems.items()
    ]
    return markdown_table(header, rows, pad=True)


def contrast_table(results: dict) -> str:
    """Compositions and merges × settings: exact match % [95 % CI] on `joint`; * where disjoint from compose's."""
    contrast = results["contrast"]
    settings = contrast["settings"]
    rows = []
    for name, cells in contrast["systems"].items():
        row = [name]
        for setting in settings:
            cell = cells.get(setting)
            star = " *" if contrast["differs"].get(setting, {}).get(name) else ""
            row.append("–" if cell is None else _cell(cell) + star)
        rows.append(row)
    return markdown_table(
        ["system", *[f"{setting} (n={_joint_n(contrast, setting)})" for setting in settings]], rows, pad=True
    )


def _joint_n(contrast: dict, setting: str) -> int | str:
    return next((cells[setting]["n"] for cells in contrast["systems"].values() if setting in cells), "–")


def _contrast_lines(results: dict) -> list[str]:
    if "contrast" not in results:
        return []
    settings = ", ".join(
        f"{name}: {_describe_variant(overrides)}" for name, overrides in results["config"].get("variants", {}).items()
    )
    return [
        f"Merging against composing on joint (length {results['data']['main_length']}), exact match % [95% CI]; "
        f"main: the config as given; {settings}. * : the interval is disjoint from compose's.",
        "",
        contrast_table(results),
        "",
    ]


def _describe_variant(overrides: dict, prefix: str = "") -> str:
    parts = []
    for key, value in overrides.items():
        if isinstance(value, dict) and value:
            parts.append(_describe_variant(value, f"{prefix}{key}."))
        else:
            parts.append(f"{prefix}{key}={value}")
    return ", ".join(parts)


def format_tables(results: dict) -> str:
    """The text printed at the end of a run (the same tables as results.md)."""
    main_length = results["data"]["main_length"]
    return "\n".join(
        [
            *_contrast_lines(results),
            f"Exact match % [95% CI] on the test splits (length {main_length} unless length_L), joint target:",
            splits_table(results),
            "",
            "Exact match % by length, each system on its own target:",
            length_table(results),
        ]
    )


def results_markdown(results: dict, task_title: str) -> str:
    """results.md; `task_title` says what the task is (the task type's `title()`)."""
    config = results["config"]
    parts = [
        f"# {config['name']}: merging and composition on {task_title} ({config['task']['formulation']})",
        "",
        f"Training lengths {results['data']['train_lengths']}; main splits at length {results['data']['main_length']}. "
        "Exact match of the greedy output up to EOS, with Wilson 95 % intervals.",
        "",
        *(["## Merging against composing", "", *_contrast_lines(results)] if "contrast" in results else []),
        "## Test splits (joint target)",
        "",
        splits_table(results),
        "",
        "## By length (own target: base = copy, expert = its skill, compose and merges = joint)",
        "",
        length_table(results),
        "",
        "![accuracy against length](length.png)",
        "",
    ]
    if results["merges"]:
        parts += ["## Merge hyperparameters (chosen on validation)", ""]
        rows = [
            [method, str(record["chosen"]), _percent(record["validation_exact_match"])]
            for method, record in results["merges"].items()
        ]
        parts += [markdown_table(["method", "chosen", "validation exact match %"], rows), ""]
    if results["skipped"]:
        parts += ["## Not evaluated", ""]
        parts += [f"- `{name}`: {reason}" for name, reason in results["skipped"].items()]
        parts += [""]
    parts += ["## Bars", ""]
    rows = [
        [
            bar["bar"],
            _percent(bar["value"]),
            str(bar["n"]),
            "yes" if bar["applies"] else "no",
            ("pass" if bar["passed"] else "FAIL") if bar["applies"] else "–",
        ]
        for bar in results["bars"]
    ]
    parts += [markdown_table(["bar", "value %", "n", "applies", "result"], rows), ""]
    checks = [(name, check) for name, record in results["systems"].items() for check in record.get("greedy_check", [])]
    if checks:
        agree = sum(check["agree"] for _, check in checks)
        total = sum(check["n"] for _, check in checks)
        parts += [
            "## Greedy decoding check",
            "",
            f"Real greedy decoding (KV cache) against the teacher-forced verdict: {agree} of {total} "
            "examples agree, over every system.",
            "",
        ]
    parts += ["## Training", ""]
    rows = [
        [
            name,
            str(record["log"]["steps"]),
            f"{record['log']['final_loss']:.5f}",
            f"{record['log']['seconds']:.1f}",
            "yes" if record["cached"] else "no",
        ]
        for name, record in results["training"].items()
    ]
    parts += [markdown_table(["component", "steps", "final loss", "seconds", "cached"], rows), ""]
    parts += ["## Timings (seconds)", "", ", ".join(f"{k}: {v}" for k, v in results["timings"].items()), ""]
    return "\n".join(parts)


def plot_lengths(results: dict, path: Path) -> None:
    """Exact match against length on each system's own target, as small multiples.

    One row per setting (the config, then each variant), one column per group (base and
    experts, compositions, merges). Within a panel each line is shifted sideways a little and
    has its own marker, so lines that coincide (often at 0 or 100 %) stay visible.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = ["main", *results.get("variants", {})]
    groups = {"components": ("base", "expert:"), "compositions": ("compose",), "merges": ("merge:",)}
    panels: dict[tuple[str, str], list[str]] = {}
    for name in results["systems"]:
        setting, _, system = name.rpartition("/")
        group = next((g for g, prefixes in groups.items() if system.startswith(prefixes)), "components")
        panels.setdefault((setting or "main", group), []).append(name)
    figure, axes = plt.subplots(
        len(settings), len(groups), figsize=(5 * len(groups), 3.4 * len(settings)), squeeze=False, sharey=True
    )
    colours = plt.get_cmap("tab10").colors
    markers = "os^vD<>ph*"
    train_max = results["data"]["train_lengths"][1]
    for row, setting in enumerate(settings):
        for column, group in enumerate(groups):
            axis = axes[row, column]
            names = panels.get((setting, group), [])
            for index, name in enumerate(names):
                record = results["systems"][name]
                lengths = [int(length) for length in record["by_length"]]
                offset = 0.6 * (index - (len(names) - 1) / 2)  # sideways, in characters
                values = [100 * value for value in record["by_length"].values()]
                axis.plot(
                    [length + offset for length in lengths],
                    values,
                    "-",
                    color=colours[index % len(colours)],
                    marker=markers[index % len(markers)],
                    markersize=4,
                    linewidth=1,
                    label=f"{name.rpartition('/')[2]} ({record['target']})",
                )
            axis.axvline(train_max, color="grey", linestyle=":", linewidth=1)
            axis.set_ylim(-4, 104)
            axis.set_title(f"{setting}: {group}", fontsize=9)
            axis.grid(alpha=0.3)
            if names:
                axis.legend(fontsize=6, loc="best")
            if row == len(settings) - 1:
                axis.set_xlabel("string length (dotted: longest training length)")
            if column == 0:
                axis.set_ylabel("exact match %")
    figure.suptitle(f"{results['config']['name']}: exact match by length, each system on its own target", fontsize=10)
    figure.tight_layout()
    try:
        atomic_save_figure(figure, path)
    finally:
        plt.close(figure)
