"""The results as tables (terminal and results.md) and the accuracy-against-length plot."""

from __future__ import annotations

from pathlib import Path

from composition.io import atomic_save_figure, atomic_write_text, markdown_table


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


def format_tables(results: dict) -> str:
    """The text printed at the end of a run (the same tables as results.md)."""
    main_length = results["data"]["main_length"]
    return "\n".join(
        [
            f"Exact match % [95% CI] on the test splits (length {main_length} unless length_L), joint target:",
            splits_table(results),
            "",
            "Exact match % by length, each system on its own target:",
            length_table(results),
        ]
    )


def write_markdown(results: dict, path: Path) -> None:
    config = results["config"]
    parts = [
        f"# {config['name']}: merging and composition on "
        f"{'sequential skills' if config['task'].get('type') == 'skills' else 'letter replacement'} ({config['task']['formulation']})",
        "",
        f"Training lengths {results['data']['train_lengths']}; main splits at length {results['data']['main_length']}. "
        "Exact match of the greedy output up to EOS, with Wilson 95 % intervals.",
        "",
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
        [bar["bar"], _percent(bar["value"]), str(bar["n"]), "yes" if bar["applies"] else "no",
         ("pass" if bar["passed"] else "FAIL") if bar["applies"] else "–"]
        for bar in results["bars"]
    ]
    parts += [markdown_table(["bar", "value %", "n", "applies", "result"], rows), ""]
    checks = [
        (name, check) for name, record in results["systems"].items() for check in record.get("greedy_check", [])
    ]
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
        [name, str(record["log"]["steps"]), f"{record['log']['final_loss']:.5f}", f"{record['log']['seconds']:.1f}",
         "yes" if record["cached"] else "no"]
        for name, record in results["training"].items()
    ]
    parts += [markdown_table(["component", "steps", "final loss", "seconds", "cached"], rows), ""]
    parts += ["## Timings (seconds)", "", ", ".join(f"{k}: {v}" for k, v in results["timings"].items()), ""]
    atomic_write_text(path, "\n".join(parts))


def plot_lengths(results: dict, path: Path) -> None:
    """Exact match against length, one line per system (own target); dashed: longest training length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(10, 5))
    colours = plt.get_cmap("tab20").colors
    markers = "os^vD<>ph*"
    for index, (name, record) in enumerate(results["systems"].items()):
        lengths = [int(length) for length in record["by_length"]]
        values = [100 * value for value in record["by_length"].values()]
        style = "-" if name.startswith(("compose", "merge")) else "--"
        axis.plot(lengths, values, style, color=colours[index % len(colours)], marker=markers[index % len(markers)],
                  markersize=5, label=f"{name} ({record['target']})")
    axis.axvline(results["data"]["train_lengths"][1], color="grey", linestyle=":", label="longest training length")
    axis.set_xlabel("string length")
    axis.set_ylabel("exact match %")
    axis.set_ylim(-2, 102)
    axis.set_title(f"{results['config']['name']}: exact match by length (own target)")
    axis.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # outside: lines often overlap at 0 and 100
    figure.tight_layout()
    try:
        atomic_save_figure(figure, path)
    finally:
        plt.close(figure)
