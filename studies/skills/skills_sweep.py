"""Compose k = 2, 3, 4, 6 experts: one `mergecompose compare` run per config, then accuracy against k.

    mergecompose skills-sweep configs/skills_k2.yaml configs/skills_k3.yaml configs/skills_k4.yaml \\
        configs/skills_k6.yaml --out runs/skills [--expert-noise 0.35]

Each config runs in `OUT/<name>/` with `OUT/<name>/checkpoints` a link to the shared
`OUT/checkpoints`: the base and expert i do not depend on k (`SkillsTaskSettings.data_recipe`),
so they are trained once, by the first config that needs them. `--expert-noise` gives the
imperfect-expert variant (noise on every full expert's task vector, added after training), and
`--checkpoints DIR` reuses another sweep's checkpoints (`OUT/checkpoints` becomes a link to DIR):

    mergecompose skills-sweep configs/skills_k2.yaml configs/skills_k3.yaml configs/skills_k4.yaml \
        configs/skills_k6.yaml --out runs/skills_noisy --expert-noise 0.35 --checkpoints runs/skills/checkpoints

Writes `OUT/summary.json`, `OUT/summary.md` and `OUT/accuracy_vs_k.png`:

* joint exact match (main length, 95 % CI) for every combined system and remedy, per k;
* the same at every `length_<L>` split;
* the failure analysis per k: early / missing EOS and where the first error falls;
* the background noise of the plain composition per k.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from mergecompose.core.io import atomic_save_figure, markdown_table
from mergecompose.experiments.compare import run_compare
from mergecompose.experiments.compare_config import CompareConfig, fingerprint, load_config
from mergecompose.experiments.evaluate import JOINT
from mergecompose.experiments.run_folder import FolderLayout, RunFolder
from mergecompose.studies.skills.skills_task_type import SkillsTaskSettings

# Any folder is accepted (the configs' run folders, the shared checkpoints); summary.json records the configs.
SKILLS_SWEEP_FOLDER = FolderLayout(
    "a skills-sweep folder",
    results="summary.json",
    hash_key="configs_hash",
    own_entries_only=False,
    other_config=(
        "{folder} holds a sweep of other configs (hash {previous}, this one is {current}); "
        "pass overwrite=True (--overwrite) or choose another folder"
    ),
)


def load_sweep_configs(paths: Sequence[str | os.PathLike], expert_noise: float | None = None) -> list[CompareConfig]:
    """The configs, each of the skills type, with distinct names and k; `expert_noise` overrides the task's."""
    if not paths:
        raise ValueError("`configs` must name at least one config file, got none")
    configs = []
    for path in paths:
        config = load_config(path)
        if not isinstance(config.task, SkillsTaskSettings):
            raise ValueError(f"{path}: `task.type` must be 'skills' for a skills sweep, got {config.task.type!r}")
        if expert_noise is not None:
            data = config.model_dump(mode="json")
            data["task"]["expert_noise"] = expert_noise
            config = CompareConfig.model_validate(data)
        configs.append(config)
    names = [config.name for config in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"the configs' `name`s must differ (each names its run folder), got {names}")
    ks = [config.task.num_experts for config in configs]
    if len(set(ks)) != len(ks):
        raise ValueError(f"the configs must compose different numbers of experts, got k = {ks}")
    return sorted(configs, key=lambda config: config.task.num_experts)


def run_skills_sweep(
    configs: Sequence[CompareConfig],
    out_dir: str | os.PathLike,
    overwrite: bool = False,
    progress: bool = True,
    threads: int | None = 1,
    echo=print,
    checkpoints: str | os.PathLike | None = None,
) -> dict:
    """Run every config (sharing checkpoints), then write the summary over k. Returns the summary.

    `checkpoints`: an existing checkpoints folder to share (e.g. another sweep's); by default
    `out_dir/checkpoints`. Sweeps that share one run side by side: each checkpoint is trained by
    the first that needs it, while the others wait for it (`mergecompose.experiments.trained_models`). A folder that
    another run is writing is refused at once.
    """
    run = RunFolder(out_dir, SKILLS_SWEEP_FOLDER)
    if checkpoints is not None and not Path(checkpoints).is_dir():
        raise ValueError(f"`checkpoints` must be an existing folder, got {str(checkpoints)!r}")
    key = fingerprint([config.model_dump(mode="json") for config in configs])
    with run.claim(key, overwrite):
        return _run_claimed(configs, key, run, overwrite, progress, threads, echo, checkpoints)


def _run_claimed(
    configs, key: str, run: RunFolder, overwrite: bool, progress: bool, threads, echo, checkpoints
) -> dict:
    out_dir = run.path
    shared = out_dir / "checkpoints"
    if checkpoints is not None:
        source = Path(checkpoints).resolve()
        if not shared.exists() and not shared.is_symlink():
            shared.symlink_to(source, target_is_directory=True)
        elif shared.resolve() != source:
            raise ValueError(f"{shared} already exists and is not a link to `checkpoints` {str(source)!r}")
    shared.mkdir(parents=True, exist_ok=True)
    runs = {}
    for config in configs:
        run_dir = out_dir / config.name
        run_dir.mkdir(exist_ok=True)
        link = run_dir / "checkpoints"
        if not link.exists():
            link.symlink_to(Path("..") / "checkpoints", target_is_directory=True)
        if echo is not None:
            echo(f"== {config.name}: k = {config.task.num_experts}")
        runs[config.name] = run_compare(
            config, run_dir, overwrite=overwrite, progress=progress, echo=None, threads=threads
        )
    summary = summarize(list(runs.values()))
    summary["configs_hash"] = key
    summary["runs"] = {name: str(out_dir / name) for name in runs}
    run.write_json("summary.json", summary)
    run.write_text("summary.md", summary_markdown(summary))
    run.write_figure("accuracy_vs_k.png", lambda path: plot_accuracy_against_k(summary, path))
    if echo is not None:
        echo(summary_markdown(summary))
        echo(f"\nsummary: {run.file('summary.json')}, {run.file('summary.md')}, {run.file('accuracy_vs_k.png')}")
    return summary


# ---------------------------------------------------------------------------------------------
# Summary over k (a function of the runs' results.json contents)


def combined_systems(results: dict) -> list[str]:
    return [name for name in results["systems"] if name.startswith(("compose", "merge:"))]


def summarize(runs: Sequence[dict]) -> dict:
    """Per system and k: joint exact match (with CI and n), per length split, and the failure analysis.

    `runs` are results dicts of `mergecompose compare` on skills configs, one per k.
    """
    ordered = sorted(runs, key=lambda results: results["config"]["task"]["num_experts"])
    ks = [results["config"]["task"]["num_experts"] for results in ordered]
    systems: dict[str, dict] = {}
    components: dict[str, dict] = {}
    noise: dict[str, dict] = {}
    for k, results in zip(ks, ordered):
        failures = results.get("skills_failures", {})
        for name in combined_systems(results):
            record = results["systems"][name]
            splits = {
                split: cell for split, cell in record["splits"].items() if split == JOINT or split.startswith("length_")
            }
            systems.setdefault(name, {})[str(k)] = {
                "joint": record["splits"][JOINT],
                "lengths": {split: cell["exact_match"] for split, cell in splits.items() if split != JOINT},
                "failures": failures.get("systems", {}).get(name, {}),
            }
        for name, record in results["systems"].items():
            if not name.startswith(("compose", "merge:")):
                components.setdefault(name, {})[str(k)] = record["by_length"]
        noise[str(k)] = failures.get("noise", {})
    return {
        "ks": ks,
        "main_length": ordered[0]["data"]["main_length"],
        "expert_noise": ordered[0]["config"]["task"].get("expert_noise", 0.0),
        "systems": systems,
        "components": components,
        "noise": noise,
    }


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def summary_markdown(summary: dict) -> str:
    ks = [str(k) for k in summary["ks"]]
    parts = [
        f"# Sequential skills: composing k experts (expert noise {summary['expert_noise']})",
        "",
        f"Joint exact match % [95 % CI] at length {summary['main_length']}, greedy output up to EOS:",
        "",
    ]
    rows = []
    for name, per_k in summary["systems"].items():
        cells = []
        for k in ks:
            cell = per_k.get(k, {}).get("joint")
            cells.append(
                "–"
                if cell is None
                else f"{_percent(cell['exact_match'])} [{_percent(cell['ci95'][0])}, {_percent(cell['ci95'][1])}]"
            )
        rows.append([name, *cells])
    parts += [markdown_table(["system", *[f"k = {k}" for k in ks]], rows), ""]

    lengths = sorted(
        {split for per_k in summary["systems"].values() for k in per_k.values() for split in k["lengths"]},
        key=lambda split: int(split.split("_")[1]),
    )
    if lengths:
        parts += ["Joint exact match % at longer inputs (k: " + ", ".join(f"{split}" for split in lengths) + "):", ""]
        rows = [
            [
                name,
                *[
                    " / ".join(_percent(per_k.get(k, {}).get("lengths", {}).get(split)) for split in lengths)
                    for k in ks
                ],
            ]
            for name, per_k in summary["systems"].items()
        ]
        parts += [markdown_table(["system", *[f"k = {k}" for k in ks]], rows), ""]

    parts += [
        "Failure analysis on `joint` (real greedy decoding), % of inputs: early EOS / EOS missing or late / "
        "first error in background · segment · boundary · end:",
        "",
    ]
    rows = []
    for name, per_k in summary["systems"].items():
        cells = []
        for k in ks:
            failure = per_k.get(k, {}).get("failures", {}).get(JOINT)
            if failure is None:
                cells.append("–")
                continue
            eos, first = failure["eos"], failure["first_error"]
            cells.append(
                f"{_percent(eos['early'])} / {_percent(eos['missing'] + eos['late'])} / "
                f"{_percent(first['background'])} · {_percent(first['segment'])} · "
                f"{_percent(first['boundary'])} · {_percent(first['end'])}"
            )
        rows.append([name, *cells])
    parts += [markdown_table(["system", *[f"k = {k}" for k in ks]], rows), ""]

    owned = [
        (name, per_k)
        for name, per_k in summary["systems"].items()
        if name.startswith("compose")
        and any("first_error_owner" in k.get("failures", {}).get(JOINT, {}) for k in per_k.values())
    ]
    if owned:
        parts += [
            "Whose segment the first error falls in, on `joint` (% of inputs, each skill's markers included):",
            "",
        ]
        rows = []
        for name, per_k in owned:
            cells = []
            for k in ks:
                by_skill = per_k.get(k, {}).get("failures", {}).get(JOINT, {}).get("first_error_owner")
                cells.append(
                    "–"
                    if by_skill is None
                    else " · ".join(f"{skill} {_percent(rate)}" for skill, rate in by_skill.items())
                )
            rows.append([name, *cells])
        parts += [markdown_table(["system", *[f"k = {k}" for k in ks]], rows), ""]

    parts += [
        "Background noise of the plain composition on `joint` (teacher-forced; per region: background / segment / "
        "boundary / end): Σ over non-owning experts of KL(p_i ‖ p_b); their summed EOS log-ratio; "
        "KL(oracle ‖ composed); "
        "% of steps where the composition's argmax differs from the owner-only oracle's:",
        "",
    ]
    rows = []
    for k in ks:
        record = summary["noise"].get(k, {}).get(JOINT)
        if not record:
            continue

        def regions(values):
            return " / ".join(
                "–" if values[r] is None else f"{values[r]:.3f}" for r in ("background", "segment", "boundary", "end")
            )

        flips = record.get("oracle_flip")
        flip_cell = (
            "–"
            if flips is None
            else " / ".join(_percent(flips[r]) for r in ("background", "segment", "boundary", "end"))
        )
        rows.append(
            [
                k,
                regions(record["inactive_activity"]),
                regions(record["eos_noise"]),
                regions(record["oracle_shift"]),
                flip_cell,
                f"{record['coactivation_rate']:.3f}",
                f"{record['spurious_activity_rate']:.3f}",
            ]
        )
    parts += [
        markdown_table(
            [
                "k",
                "Σ inactive KL",
                "Σ inactive EOS log-ratio",
                "KL(oracle ‖ composed)",
                "argmax flips %",
                "co-activation",
                "spurious activity",
            ],
            rows,
        ),
        "",
    ]

    parts += ["Components on their own targets, exact match % by length (per k run; the same checkpoints):", ""]
    rows = []
    for name, per_k in summary["components"].items():
        last = per_k[max(per_k, key=int)]
        rows.append([name, " / ".join(f"{length}: {_percent(value)}" for length, value in last.items())])
    parts += [
        markdown_table(["component", "exact match % by length"], rows),
        "",
        "![accuracy against k](accuracy_vs_k.png)",
        "",
    ]
    return "\n".join(parts)


def plot_accuracy_against_k(summary: dict, path: Path) -> None:
    """Left: joint exact match against k, one line per system and remedy (95 % CI bars). Right: early or missing EOS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    colours = plt.get_cmap("tab10").colors
    markers = "os^vD<>ph*"
    count = len(summary["systems"])
    for index, (name, per_k) in enumerate(summary["systems"].items()):
        ks = sorted(per_k, key=int)
        offset = 0.25 * (index - (count - 1) / 2) / max(1, count - 1)  # side by side, so equal values stay visible
        x = [int(k) + offset for k in ks]
        values = [100 * per_k[k]["joint"]["exact_match"] for k in ks]
        low = [v - 100 * per_k[k]["joint"]["ci95"][0] for v, k in zip(values, ks)]
        high = [100 * per_k[k]["joint"]["ci95"][1] - v for v, k in zip(values, ks)]
        style = dict(
            color=colours[index % len(colours)],
            marker=markers[index % len(markers)],
            linestyle="--" if name.startswith("merge:") else "-",
            markersize=5,
            label=name,
        )
        left.errorbar(x, values, yerr=[low, high], capsize=3, **style)
        eos = [per_k[k].get("failures", {}).get(JOINT) for k in ks]
        if all(record is not None for record in eos):
            right.plot(x, [100 * (r["eos"]["early"] + r["eos"]["missing"] + r["eos"]["late"]) for r in eos], **style)
    for axis, label in [(left, "joint exact match %"), (right, "EOS early, late or missing, % of inputs")]:
        axis.set_xlabel("k (experts composed)")
        axis.set_ylabel(label)
        axis.set_xticks(summary["ks"])
        axis.grid(alpha=0.3)
    left.set_ylim(-2, 102)
    left.legend(fontsize=7, loc="lower left")
    figure.suptitle(f"Sequential skills, length {summary['main_length']}, expert noise {summary['expert_noise']}")
    figure.tight_layout()
    try:
        atomic_save_figure(figure, path)
    finally:
        plt.close(figure)
