"""`mergecompose compare`: train (or load) the components, build every system, evaluate all on the same data.

Systems:

    base                   the base, on copying
    expert:<name>          each expert, full (fine-tuned from the base, or trained alone)
    expert:<name>:lora     each expert as a peft LoRA adapter on the base
    compose                ComposedLM(base, full joint experts)
    compose:lora           ComposedLM.from_adapters(base, joint adapters): one base copy
    compose+<name>         ComposedLM(base, full joint experts) with the config's remedy set <name>
    merge:<method>         mergecompose.merging.merge(method, base, full joint experts), hyperparameters
                           chosen on the validation splits (the mean exact match over them)

Every system is scored on every test split against the joint target, and on its own target
per length (`by_length`): the base on copying, an expert on its skill, the rest on the joint task.
The task type (`config.task`, registered in `mergecompose.experiments.plugins`: letters, skills) gives
the training data, the evaluation data and any extra results sections.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel
from tqdm.auto import tqdm

from mergecompose.composition import ComposedLM
from mergecompose.core.cli_common import check_free_disk
from mergecompose.core.executor import Executor
from mergecompose.core.io import atomic_write_text
from mergecompose.experiments.compare_config import CompareConfig, config_fingerprint, fingerprint, user_code_hashes
from mergecompose.experiments.compare_report import format_tables, plot_lengths, results_markdown
from mergecompose.experiments.evaluate import JOINT, EvalData, greedy_agreement, mean_exact_match, score, summary
from mergecompose.experiments.merge_selection import best_per_method, merged_model, search_merges
from mergecompose.experiments.plugins import compare_kind_of
from mergecompose.experiments.run_folder import FolderLayout, RunFolder, Stopwatch
from mergecompose.experiments.scored_systems import (
    BASE,
    ComposedModel,
    SingleModel,
    System,
    expert_name,
    merge_name,
    remedy_name,
)
from mergecompose.experiments.trained_models import Components, prepare_components

BAR = 0.99  # the bar for components and for the composition

# config.yaml is written before results.json, so a run killed between the two leaves it beside the checkpoints.
COMPARE_FOLDER = FolderLayout("a compare run folder", cached=("checkpoints", "config.yaml"))


@dataclass
class RunContext:
    """What a results section gets: the config, the trained components, the data, and each system's loaded model
    (`mergecompose.experiments.scored_systems.SingleModel` or `ComposedModel`) by system name."""

    config: CompareConfig
    components: Components
    data: EvalData
    systems: dict
    curve_of: dict[str, str]


# A results section: name -> function of the run's context returning a JSON-able dict, stored as
# results[name]. Diagnostics from the `analysis` package attach here.
Section = Callable[[RunContext], dict]


def run_compare(
    config: CompareConfig,
    out_dir: str | os.PathLike,
    overwrite: bool = False,
    progress: bool = True,
    sections: Mapping[str, Section] | None = None,
    echo: Callable[[str], None] | None = print,
    threads: int | None = 1,
    checked: bool = False,
    executor: Executor | None = None,
) -> dict:
    """Run the whole comparison and write `results.json`, `results.md`, `length.png`, `config.yaml` to `out_dir`.

    `out_dir` keeps its `checkpoints/` between runs (reused by hash). A folder that holds the
    results of another config, or that is not a compare folder, is refused unless `overwrite`; so is
    one that another run is writing (`mergecompose.experiments.run_folder.RunFolder.claim`), at once.
    `threads`: torch's intra-op threads during the run (restored after); the models are so
    small that one thread is fastest, and several are much slower on a loaded machine.
    Returns the results dict (the content of results.json).

    A config of another compare kind (`mergecompose.experiments.plugins.compare_kinds`, e.g. `type: lm_eval`)
    is run by that kind's own function, under the same `threads`; `sections` apply to `CompareConfig` only.

    `executor` (`mergecompose.core.executor`): where a `type: lm_eval` compare's cells run (default: here).

    Everything is checked first (`preflight_compare`), unless `checked`: the caller ran it on this config and
    folder just before (the command line does, once, before `--check` would stop).
    """
    kind = compare_kind_of(config)
    if not checked:
        preflight_compare(config, out_dir, overwrite)
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        if kind is not None:
            options = {} if executor is None else {"executor": executor}
            return kind.run(config, Path(out_dir), overwrite=overwrite, progress=progress, echo=echo, **options)
        if executor is not None and executor.name != "local":
            raise ValueError(
                f"`--executor {executor.name}` runs the cells of a compare kind that caches per cell "
                "(`type: lm_eval`); this config's compare runs here (--executor local)"
            )
        return _run(config, Path(out_dir), overwrite, progress, sections, echo)
    finally:
        torch.set_num_threads(previous_threads)


def preflight_compare(
    config: BaseModel, out_dir: str | os.PathLike, overwrite: bool = False, config_path: str | os.PathLike | None = None
) -> None:
    """Check, before any work, what the comparison needs to its last step; load no model and write nothing.

    The run folder must be new, this config's, or replaceable (`overwrite`); its disk must hold the checkpoints
    the run writes (estimated from the model's size); a compare kind of its own (`type: lm_eval`) checks the
    rest itself (`CompareKind.preflight`: tasks, metrics, devices, vocabularies). `mergecompose compare --check`
    runs this alone.
    """
    kind = compare_kind_of(config)
    if kind is None:
        RunFolder(out_dir, COMPARE_FOLDER).check(config_fingerprint(config), overwrite)
        model = config.model
        shape = f"`model.hidden_size` {model.hidden_size}, `model.num_layers` {model.num_layers}"
        check_free_disk(out_dir, synthetic_checkpoint_bytes(config), f"the checkpoints of this comparison ({shape})")
    elif kind.preflight is not None:
        kind.preflight(config, out_dir, overwrite, config_path)


def synthetic_checkpoint_bytes(config: CompareConfig) -> int:
    """About how many bytes the checkpoints of a synthetic comparison take: a float32 model per trained component
    (the base, each full expert and its variants' copies) and a LoRA adapter each (counted as a full copy, an
    upper bound), from the model's shape and a vocabulary of up to 512 ids."""
    model = config.model
    hidden, layers = model.hidden_size, model.num_layers
    intermediate = model.intermediate_size or hidden * (2 if model.architecture == "llama" else 4)
    parameters = layers * (4 * hidden * hidden + 3 * hidden * intermediate) + 2 * 512 * hidden
    components = 1 + 2 * len(config.task.trained_skills())
    return 4 * parameters * components * (1 + len(config.variants))


@dataclass
class Setting:
    """One setting of the comparison (the config itself, or one of its variants), evaluated."""

    context: RunContext
    evaluated: dict
    merges: dict


def _run(config, out_dir: Path, overwrite, progress, sections, echo) -> dict:
    config_hash = config_fingerprint(config)
    run = RunFolder(out_dir, COMPARE_FOLDER)
    with run.claim(config_hash, overwrite):
        return _run_claimed(config, config_hash, run, progress, sections, echo)


def _run_claimed(config, config_hash: str, run: RunFolder, progress, sections, echo) -> dict:
    main = _run_setting(config, run.path, progress, run.clock)
    components, data = main.context.components, main.context.data
    results = {
        "config": config.model_dump(mode="json"),
        "config_hash": config_hash,
        "systems": main.evaluated,
        "merges": main.merges,
        "skipped": _skipped(config),
        "bars": check_bars(config, main.evaluated),
        "training": components.training,
        "checkpoints": {
            "base": str(components.base_dir),
            "experts": {name: str(path) for name, path in components.experts.items()},
            "adapters": {name: str(path) for name, path in components.adapters.items()},
        },
        "data": {
            "test": {name: len(eval_set) for name, eval_set in data.test.items()},
            "validation": {name: len(eval_set) for name, eval_set in data.validation.items()},
            "main_length": config.eval_length,
            "train_lengths": list(config.task.train_lengths),
        },
    }
    for name, section in {**config.task.sections(), **(sections or {})}.items():
        results[name] = section(main.context)
    if config.variants:
        results["variants"] = {}
        for variant, variant_config in config.variant_configs().items():
            with run.stage(f"variant:{variant}"):  # a variant's own stages are not recorded
                setting = _run_setting(variant_config, run.path, progress, Stopwatch())
                systems = {f"{variant}/{name}": record for name, record in setting.evaluated.items()}
                results["systems"].update(systems)
                results["variants"][variant] = {
                    "config": variant_config.model_dump(mode="json"),
                    "merges": setting.merges,
                    "skipped": _skipped(variant_config),
                    "training": setting.context.components.training,
                }
        results["contrast"] = contrast(results)
    results["timings"] = {**run.timings, "total": run.elapsed()}

    run.write_config(config)
    run.write_json("results.json", results)
    run.write_text("results.md", results_markdown(results, config.task.title()))
    run.write_figure("length.png", lambda path: plot_lengths(results, path))
    plots = ["length.png", *config.task.plots(results, run.path)]
    if echo is not None:
        echo(format_tables(results))
        echo(
            f"\nresults: {run.file('results.json')}, {run.file('results.md')}, "
            + ", ".join(str(run.file(name)) for name in plots)
        )
    return results


def _run_setting(config: CompareConfig, out_dir: Path, progress: bool, clock: Stopwatch) -> Setting:
    """Train or load the components, build every system, choose the merges, evaluate everything."""
    with clock.stage("train_or_load"):
        components = prepare_components(config, out_dir, progress)
    with clock.stage("data"):
        data = config.task.eval_data(config.evaluation, config.eval_length, config.task.train_lengths[1])
    with clock.stage("systems_and_merge_selection"):
        systems, curve_of = _single_systems(config, components)
        systems.update(_compositions(config, components))
        models = {name: system.load() for name, system in systems.items()}
        merges = _select_merges(config, components, data, out_dir / "checkpoints", progress)
        for method, record in merges.items():
            models[merge_name(method)] = record.pop("system").load()
        for name in models:
            curve_of.setdefault(name, JOINT)  # compositions and merges: the joint task
    with clock.stage("evaluation"):
        evaluated = _evaluate(config, components, data, models, curve_of, progress)
    return Setting(RunContext(config, components, data, models, curve_of), evaluated, merges)


def contrast(results: dict) -> dict:
    """Every composition and merge on `joint`, per setting (the config, then each variant).

    `differs[setting][system]`: whether the system's 95 % interval is disjoint from `compose`'s
    there, i.e. merging and composing differ measurably.
    """
    settings = ["main", *results.get("variants", {})]
    table: dict = {"settings": settings, "systems": {}, "differs": {}}
    for setting in settings:
        prefix = "" if setting == "main" else f"{setting}/"
        cells = {
            name[len(prefix) :]: record["splits"][JOINT]
            for name, record in results["systems"].items()
            if name.startswith(prefix)
            and "/" not in name[len(prefix) :]
            and name[len(prefix) :].startswith(("compose", "merge:"))
        }
        for name, cell in cells.items():
            table["systems"].setdefault(name, {})[setting] = {k: cell[k] for k in ("exact_match", "ci95", "n")}
        reference = cells.get("compose")
        if reference is not None:
            table["differs"][setting] = {
                name: cell["ci95"][1] < reference["ci95"][0] or cell["ci95"][0] > reference["ci95"][1]
                for name, cell in cells.items()
                if name != "compose"
            }
    return table


# ---------------------------------------------------------------------------------- systems


def _single_systems(config: CompareConfig, components: Components) -> tuple[dict[str, System], dict[str, str]]:
    """The base (scored on copying) and each expert, full and LoRA (each scored on its skill)."""
    systems = {BASE: System(BASE, lambda: SingleModel(components.load_base()))}
    curve_of = {BASE: "copy"}
    for name in config.task.trained_skills():
        systems[expert_name(name)] = System(
            expert_name(name), lambda name=name: SingleModel(components.load_expert(name))
        )
        curve_of[expert_name(name)] = f"skill:{name}"
        if name in components.adapters:
            systems[expert_name(name, lora=True)] = System(
                expert_name(name, lora=True), lambda name=name: SingleModel(components.load_adapter(name))
            )
            curve_of[expert_name(name, lora=True)] = f"skill:{name}"
    return systems, curve_of


def _compositions(config: CompareConfig, components: Components) -> dict[str, System]:
    """`compose` and each remedy set on one copy of the base and the joint experts; `compose:lora` on its own."""
    joint = config.task.joint

    @functools.cache
    def shared() -> tuple:  # loaded once, for every composition of the full experts
        return components.load_base(), [components.load_expert(name) for name in joint]

    def composed(remedies=()) -> ComposedModel:
        base, experts = shared()
        return ComposedModel(ComposedLM(base, experts, remedies=remedies))

    systems = {"compose": System("compose", composed)}
    eos = components.tokenizer.eos_token_id
    for name, remedy in config.remedies.items():  # the same models under each remedy set
        systems[remedy_name(name)] = System(remedy_name(name), lambda remedy=remedy: composed(remedy.build(eos)))
    if all(name in components.adapters for name in joint):
        adapters = {name: str(components.adapters[name]) for name in joint}
        systems["compose:lora"] = System(
            "compose:lora", lambda: ComposedModel(ComposedLM.from_adapters(components.load_base(), adapters))
        )
    return systems


def _select_merges(
    config: CompareConfig, components: Components, data: EvalData, cache_dir: Path, progress: bool
) -> dict:
    """For each method, the grid point with the best mean validation exact match (the first one on ties).

    The sweep is cached beside the checkpoints, keyed by the checkpoints' hashes, the task, the
    evaluation settings (which fix the validation strings), the grid and the seed; a cached run
    builds only the chosen merges. Each record holds the chosen merge's `System` under "system".
    """
    if not config.merges:
        return {}
    base = components.load_base()
    experts = [components.load_expert(name) for name in config.task.joint]
    seed = config.seed_merges

    def merge_system(method: str, params: dict, name: str | None = None) -> System:
        name = merge_name(method, params) if name is None else name
        return System(name, lambda: SingleModel(merged_model(base, experts, method, params, seed)))

    key = fingerprint(
        {
            "checkpoints": {name: record["fingerprint"] for name, record in components.training.items()},
            "task": config.task.model_dump(mode="json"),
            "evaluation": config.evaluation.model_dump(mode="json"),
            "merges": {method: grid.model_dump(mode="json") for method, grid in config.merges.items()},
            "seed": seed,
            **({"user_code": hashes} if (hashes := user_code_hashes(config)) else {}),
        }
    )
    cache = cache_dir / f"merge-selection-{key}.json"
    cached = cache.is_file()
    if cached:
        selection = json.loads(cache.read_text())
    else:
        validation = list(data.validation.values())
        fmt, tokenizer, batch_size = components.format, components.tokenizer, config.evaluation.batch_size

        def validation_exact_match(system: System) -> float:
            return mean_exact_match(system.load(), validation, fmt, tokenizer, batch_size)

        grids = {method: grid.candidates() for method, grid in config.merges.items()}
        records = search_merges(grids, merge_system, validation_exact_match, progress)
        best = best_per_method(records)
        selection = {
            method: {
                "chosen": best[method]["params"],
                "validation_exact_match": best[method]["score"],
                "validation": [
                    {**r["params"], "mean_exact_match": r["score"]} for r in records if r["method"] == method
                ],
            }
            for method in grids
        }
        atomic_write_text(cache, json.dumps(selection, indent=1))
    return {
        method: {**record, "cached": cached, "system": merge_system(method, record["chosen"], merge_name(method))}
        for method, record in selection.items()
    }


def _skipped(config: CompareConfig) -> dict[str, str]:
    skipped = {}
    if config.training.experts.init == "scratch":
        reason = "experts trained from scratch have no task vectors relative to the base"
        for method in CompareConfig.model_fields["merges"].default_factory():
            skipped[merge_name(method)] = reason
        skipped["compose:lora"] = "LoRA adapters need experts fine-tuned from the base"
    elif config.training.experts.lora is None:
        skipped["compose:lora"] = "no LoRA recipe in the config (`training.experts.lora`)"
    return skipped


# ---------------------------------------------------------------------------------- evaluation


def _evaluate(
    config: CompareConfig, components: Components, data: EvalData, models: dict, curve_of: dict, progress: bool
) -> dict:
    """Each system's record: every test split, its own curve by length, the greedy check, its seconds."""
    fmt, tokenizer, batch_size = components.format, components.tokenizer, config.evaluation.batch_size
    check = config.evaluation.greedy_check if config.task.formulation == "seq2seq" else 0
    # Real greedy decoding on the first `check` strings of `joint` and of the longest length split.
    longest = max(data.test.values(), key=lambda eval_set: eval_set.length)
    checked = {JOINT, longest.name}
    results = {}
    for name, model in tqdm(models.items(), desc="evaluate", disable=not progress, leave=False):
        watch = Stopwatch()
        splits, agreement = {}, []
        for split, eval_set in data.test.items():
            scored = score(model, eval_set, fmt, tokenizer, batch_size)
            splits[split] = summary(scored)
            if check and split in checked:
                agreement.append(greedy_agreement(model, eval_set.head(check), fmt, tokenizer, batch_size, scored))
        by_length, by_length_ci, by_length_n, by_length_first_error = {}, {}, {}, {}
        for length, eval_set in data.curves[curve_of[name]].items():
            # The joint curve shares its sets with the test splits (`joint`, `length_L`).
            shared = data.test.get(eval_set.name)
            cell = (
                splits[eval_set.name]
                if shared is eval_set
                else summary(score(model, eval_set, fmt, tokenizer, batch_size))
            )
            by_length[str(length)] = cell["exact_match"]
            by_length_ci[str(length)] = cell["ci95"]
            by_length_n[str(length)] = cell["n"]
            by_length_first_error[str(length)] = cell["first_error"]
        results[name] = {
            "target": curve_of[name],
            "splits": splits,
            "by_length": by_length,
            "by_length_ci95": by_length_ci,
            "by_length_n": by_length_n,
            "by_length_first_error": by_length_first_error,
            "greedy_check": agreement,
            "seconds": watch.elapsed(),
        }
    return results


def check_bars(config: CompareConfig, systems: dict) -> list[dict]:
    """The issue's bars, each with its value and whether it applies and passes.

    * the base ≥ 99 % on copying and each expert ≥ 99 % on its skill, at every evaluated
      length within the training lengths;
    * compose ≥ 99 % on `joint` at the main length, with at least 1,000 strings;
    * compose ≥ 99 % at 2× the longest training length, where every component is ≥ 99 % there.
    """
    low, high = config.task.train_lengths
    lengths = [length for length in config.evaluation.lengths if low <= length <= high]
    bars = []

    def add(text, value, applies=True, n=None):
        bars.append({"bar": text, "value": value, "n": n, "applies": applies, "passed": applies and value >= BAR})

    for name, record in systems.items():
        if name.startswith(("compose", "merge")):
            continue
        for length in lengths:
            add(
                f"{name} on {record['target']} at length {length} >= {BAR:.0%}",
                record["by_length"][str(length)],
                n=record["by_length_n"][str(length)],
            )
    for name, suffix in (("compose", ""), ("compose:lora", ":lora")):
        if name not in systems:
            continue
        joint = systems[name]["splits"][JOINT]
        add(
            f"{name} on joint at length {config.eval_length} >= {BAR:.0%} (n >= 1000)",
            joint["exact_match"],
            applies=joint["n"] >= 1000,
            n=joint["n"],
        )
        double = str(2 * high)
        if double in systems[name]["by_length"]:
            components = ["base", *[f"expert:{expert}{suffix}" for expert in config.task.joint]]
            ready = all(systems[c]["by_length"].get(double, 0.0) >= BAR for c in components if c in systems)
            add(
                f"{name} on joint at length {double} >= {BAR:.0%} (applies where every component is >= {BAR:.0%})",
                systems[name]["by_length"][double],
                applies=ready,
                n=systems[name]["by_length_n"][double],
            )
    return bars
