"""`mergecompose real-sweep`: the real settings from nothing: experts, their bars, every setting, its label.

Stages, each timed and cached in the run folder, so an interrupted sweep resumes where it stopped, on this machine
or another that is given the folder:

1. **base**: a registry model by name (`fetch-model`, into the model cache) or a local folder;
2. **experts**: one `SkillRecipe` expert per skill (`OUT/experts`, shared by every setting that uses it);
3. **bars**: the base and each expert on the skill's own held-out test split (`OUT/bars`); an expert below its bar
   stops the sweep there, before any setting is evaluated, in one line naming both scores;
4. **settings**: each setting's `SettingRun` (`OUT/settings/<name>/cells`), its label, and its diagnostics: the
   flat `unlabelled_diagnostics` of the composition's own rollouts on the joint validation prompts, with the
   task-arithmetic merge at λ = 1 for the merge–compose gap and the experts' task vectors, and each expert on its
   own skill's validation prompts (`own_prompt_statistics`) (`diagnostics.json`);
5. **outputs**: results.json, results.md, and one plot per diagnostic against (best composition − best merge).
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import numpy as np
from pydantic import Field, field_validator, model_validator
from scipy.stats import spearmanr
from transformers import AutoTokenizer

from mergecompose.analysis import OverlapSettings, rollout_batches
from mergecompose.analysis.own_prompts import OWN_PROMPT_STATISTICS, own_prompt_reports, own_prompt_statistics
from mergecompose.analysis.paired_outcome import OUTCOMES
from mergecompose.analysis.predict import diagnostic_names, unlabelled_diagnostics
from mergecompose.composition.remedies import RemedySettings
from mergecompose.core.boundary import check_checkpoint
from mergecompose.core.executor import (
    Cell,
    Executor,
    LocalExecutor,
    ResourcesConfig,
    cell_runs,
    raise_if_failed,
    run_cells,
)
from mergecompose.core.io import StrictModel, atomic_write_text, markdown_table
from mergecompose.experiments.compare_config import MergeGrid, check_some_merge_grids, fingerprint
from mergecompose.experiments.run_folder import FolderLayout, RunFolder
from mergecompose.integrations.gguf.fetch import MODELS, fetch_model
from mergecompose.studies.math_code.chat_data import chat_format, end_of_turn_id, generation_inputs
from mergecompose.studies.predict.paired_verdict import real_settings
from mergecompose.studies.predict.paired_verdict_report import GAP_PLOT, plot_diagnostics_against_gap
from mergecompose.studies.skill_pairs.setting_run import SettingRun
from mergecompose.studies.skill_pairs.skill_data import joint_items, pair_problem, skill_items
from mergecompose.studies.skill_pairs.skill_experts import SkillRecipe, check_expert_bar, train_skill_expert

CACHED = ("experts", "bars", "settings")
REAL_FOLDER = FolderLayout("a real-sweep folder", cached=CACHED, leftovers=CACHED)


class Sizes(StrictModel):
    bar: int = Field(64, ge=1)  # each skill's held-out test items, for the bars
    validation: int = Field(40, ge=1)  # joint validation items: the choices, and the diagnostics' prompts
    test: int = Field(200, ge=1)  # joint test items: the label


class RealSweepConfig(StrictModel):
    """The real sweep (see the module docstring); `settings` are pairs `[first, second]` of skills."""

    name: str = Field(min_length=1)
    base: str = "smollm2-135m-instruct"
    recipe: dict = Field(default_factory=dict)  # SkillRecipe's fields but the skill, shared by every expert
    settings: list[tuple[str, str]] = Field(min_length=1)
    sizes: Sizes = Field(default_factory=Sizes)
    max_new_tokens: int = Field(48, ge=1)
    batch_size: int = Field(32, ge=1)
    # What each cell asks of a Ray node (`--executor ray`); not part of the config's fingerprint.
    resources: ResourcesConfig = ResourcesConfig()
    merges: dict[str, MergeGrid] = Field(
        default_factory=lambda: {
            "task_arithmetic": MergeGrid(lam=[0.5, 1.0, 1.5]),
            "ties": MergeGrid(lam=[1.0, 1.5], density=[0.5]),
        }
    )
    weights: list[float] = Field(default_factory=lambda: [1.0, 0.75], min_length=1, max_length=3)
    remedies: dict[str, RemedySettings] = Field(
        default_factory=lambda: {"gate": RemedySettings(gate=0.1), "shared_delta": RemedySettings(shared_delta=True)}
    )
    diagnostics: OverlapSettings = Field(default_factory=OverlapSettings)
    rollout_tokens: int = Field(32, ge=1)
    seed: int = Field(0, ge=0)
    # An expert below its bar stops the sweep (the default); false only records it (`below_bar`), for
    # scaled-down copies whose experts train for a few steps.
    require_real_experts: bool = True

    @field_validator("settings")
    @classmethod
    def _known_skills(cls, settings: list[tuple[str, str]]) -> list[tuple[str, str]]:
        for index, (first, second) in enumerate(settings):
            problem = pair_problem(first, second)
            if problem is not None:
                raise ValueError(f"`settings[{index}]`: {problem}")
        if len(set(settings)) != len(settings):
            raise ValueError("`settings` must not repeat a pair")
        return settings

    @field_validator("recipe")
    @classmethod
    def _recipe_fields(cls, recipe: dict) -> dict:
        """The recipe's keys are `SkillRecipe`'s fields but `skill`, which each expert sets itself."""
        fields = sorted(set(SkillRecipe.model_fields) - {"skill"})
        for key in recipe:
            if not isinstance(key, str) or key not in fields:
                why = "is set for each expert by the sweep" if key == "skill" else "is not a recipe field"
                raise ValueError(f"`recipe` key {key!r} {why}; the recipe's keys are {', '.join(fields)}")
        return recipe

    @field_validator("merges")
    @classmethod
    def _known_methods(cls, merges: dict[str, MergeGrid]) -> dict[str, MergeGrid]:
        return check_some_merge_grids(merges)  # an unknown method or a bad grid point is refused at --check

    @model_validator(mode="after")
    def _recipe_and_grids(self) -> RealSweepConfig:
        for skill in self.skills:
            SkillRecipe(skill=skill, **self.recipe)  # refuses an unknown or bad field, naming it
        for method, grid in self.merges.items():
            if len(grid.candidates()) > 3:
                raise ValueError(f"`merges.{method}` must have at most 3 grid points, got {len(grid.candidates())}")
        return self

    @property
    def skills(self) -> list[str]:
        return list(dict.fromkeys(skill for pair in self.settings for skill in pair))

    def setting_name(self, pair: tuple[str, str]) -> str:
        return f"{pair[0]}+{pair[1]}"


def base_folder(base: str) -> str:
    """A registry model's folder (fetched into the model cache once), or `base` itself: a folder or a hub id."""
    return str(fetch_model(base)) if base in MODELS else base


def preflight_real_sweep(config: RealSweepConfig) -> None:
    """What can be checked before any work: the base, a registry model's name or a checkpoint (folder or hub id,
    checked at the loading boundary); the config checked itself."""
    if config.base not in MODELS:
        check_checkpoint(config.base, "base")
        check_chat_format(config.base)


def check_chat_format(base: str) -> None:
    """The base's tokenizer has a chat format the skills' data can be written in (`chat_format`); the error names
    `base`."""
    try:
        chat_format(AutoTokenizer.from_pretrained(base))
    except ValueError as error:
        raise ValueError(f"`base` {base!r}: {error}") from None


def run_real_sweep(
    config: RealSweepConfig,
    out_dir: str | os.PathLike,
    overwrite: bool = False,
    progress: bool = True,
    echo=print,
    executor: Executor | None = None,
) -> dict:
    """Run every stage (see the module docstring), resuming from what `out_dir` holds; returns results.json.

    The cells (`mergecompose.core.executor`), run by `executor` (default: here, one after another), in three rounds:
    each skill's expert (`experts/<skill>`), each expert's bar (`bars/<skill>`), and, once the bars are checked, each
    setting (`settings/<name>`). Each round is a stage of `stage_seconds`; each cell's seconds and where it ran are
    in `cells`. A failed cell is reported, the others go on, and `CellsFailed` is
    raised with no results.json written."""
    preflight_real_sweep(config)
    run = RunFolder(out_dir, REAL_FOLDER)
    config_hash = fingerprint(config.model_dump(mode="json", exclude={"resources"}))
    with run.claim(config_hash, overwrite):
        with run.stage("base"):
            base = base_folder(config.base)
            check_chat_format(base)  # a registry model's, once it is fetched
        root = str(run.path)
        train, score = config.resources.train.resources(), config.resources.cell.resources()
        with run.stage("experts"):
            cells = [
                Cell(f"experts/{skill}", _expert_cell, (config, base, skill, root), train) for skill in config.skills
            ]
            runs = run_cells(cells, executor, progress, desc="experts")
            raise_if_failed(runs)
            experts = {skill: Path(runs[f"experts/{skill}"].value) for skill in config.skills}
        with run.stage("bars"):
            cells = [Cell(f"bars/{skill}", _bar_cell, (config, base, skill, root), score) for skill in config.skills]
            runs.update(run_cells(cells, executor, progress, desc="bars"))
            raise_if_failed(runs)
            bars = {skill: runs[f"bars/{skill}"].value for skill in config.skills}
            if echo is not None:
                for skill, expert in experts.items():
                    echo(f"expert {skill}: {expert.name}")
            below_bar = []
            for skill, scores in bars.items():
                try:
                    check_expert_bar(skill, scores["base"], scores["expert"])
                except ValueError:
                    if config.require_real_experts:
                        raise
                    below_bar.append(skill)
        with run.stage("settings"):
            cells = [  # their experts are done (above)
                Cell(f"settings/{config.setting_name(pair)}", _setting_cell, (config, base, tuple(pair), root), score)
                for pair in config.settings
            ]
            setting_runs = run_cells(cells, executor, progress, desc="settings")
            raise_if_failed(setting_runs)
            settings = [setting_runs[cell.name].value for cell in cells]
            runs.update(setting_runs)
        if echo is not None:
            for pair, setting in zip(config.settings, settings):
                echo(f"{config.setting_name(pair)}: {setting['outcome']['label']}")
        results = {
            "name": config.name,
            "config_hash": config_hash,
            "base": config.base,
            "bars": bars,
            "below_bar": below_bar,
            "settings": settings,
            "claims": paper_claims(settings),
            "stage_seconds": run.timings,
            "work_seconds": work_seconds(experts, settings),
            "seconds": run.elapsed(digits=1),
            "cells": {"executor": (executor or LocalExecutor()).name, "runs": cell_runs(runs)},
        }
        run.write_json("results.json", results)
        run.write_figure(GAP_PLOT, lambda path: plot_diagnostics_against_gap(real_settings(results), path))
        run.write_text("results.md", results_markdown(results))
        run.write_config(config)
    return results


def _expert_cell(config: RealSweepConfig, base: str, skill: str, root: str) -> str:
    """Skill `skill`'s expert, from the run folder's cache or trained now: its folder."""
    return str(train_skill_expert(base, SkillRecipe(skill=skill, **config.recipe), root, progress=False))


def _bar_cell(config: RealSweepConfig, base: str, skill: str, root: str) -> dict:
    """The base's and the expert's scores on the expert's own skill (cached in the run folder)."""
    return expert_scores(config, base, skill, Path(_expert_cell(config, base, skill, root)), Path(root))


def _setting_cell(config: RealSweepConfig, base: str, pair: tuple[str, str], root: str) -> dict:
    """One setting's record (cached in its folder), its experts read from the run folder's cache."""
    experts = {skill: Path(_expert_cell(config, base, skill, root)) for skill in dict.fromkeys(pair)}
    return setting_record(config, base, pair, experts, Path(root), False)


def expert_scores(config: RealSweepConfig, base: str, skill: str, expert: Path, root: Path) -> dict:
    """The base's and the expert's lenient and strict scores on `skill`'s own held-out test split (cached)."""
    items = skill_items(skill, "test", config.sizes.bar, config.seed)
    setting = SettingRun(
        base,
        {skill: expert},
        root / "bars" / skill,
        config.max_new_tokens,
        config.batch_size,
        progress=False,
    )
    scores = {}
    for system, build in (("base", lambda: setting.base), ("expert", lambda: setting.expert_model(skill))):
        cell = setting.cell(system, "test", items, build)
        scores[system] = {"lenient": cell["accuracy"], "strict": cell["strict_accuracy"]}
    return scores


def setting_record(
    config: RealSweepConfig, base: str, pair: tuple[str, str], experts: dict, root: Path, progress: bool
) -> dict:
    """One setting: its systems' scores, its label, and its diagnostics (cached in its folder)."""
    name = config.setting_name(pair)
    folder = root / "settings" / name
    started = time.perf_counter()
    setting = SettingRun(
        base, {skill: experts[skill] for skill in pair}, folder, config.max_new_tokens, config.batch_size, progress
    )
    validation = joint_items(*pair, "validation", config.sizes.validation, config.seed)
    test = joint_items(*pair, "test", config.sizes.test, config.seed)
    merges = {method: grid.candidates() for method, grid in config.merges.items()}
    record = {
        "name": name,
        "skills": list(pair),
        **setting.run(validation, test, merges, config.weights, config.remedies),
    }
    record["diagnostics"] = setting_diagnostics(config, setting, validation, folder)
    chosen = record["chosen"]
    record["compose_minus_merge"] = (
        record["test"][chosen["compose"]["system"]]["accuracy"] - record["test"][chosen["merge"]["system"]]["accuracy"]
    )
    record["seconds"] = round(time.perf_counter() - started, 1)
    return record


def setting_diagnostics(config: RealSweepConfig, setting: SettingRun, items, folder: Path) -> dict:
    """`unlabelled_diagnostics` of the composition (weights 1) on its own rollouts of the validation prompts, with the
    LoRA experts' input interference; and `own_prompt_statistics`: each expert's greedy rollouts of as many of its own
    skill's validation prompts (no joint item), measured through every model.

    Cached in `diagnostics.json` apart from the systems' cells, in two groups: a cached file that lacks one of
    today's diagnostics of a group (`diagnostic_names`, or `OWN_PROMPT_STATISTICS`: e.g. a setting measured before
    they were added) has that group measured again, and only it, so an existing setting gains the new diagnostics
    without re-evaluating its systems or the other group."""
    path = folder / "diagnostics.json"
    cached = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    rollout_missing = not set(diagnostic_names(config.diagnostics)) <= set(cached)
    own_missing = not set(OWN_PROMPT_STATISTICS) <= set(cached)
    if not rollout_missing and not own_missing:
        return cached
    stop = end_of_turn_id(setting.tokenizer)

    def batches_of(prompts: list[str]) -> list[dict]:
        return [generation_inputs(setting.tokenizer, prompts[i : i + 8]) for i in range(0, len(prompts), 8)]

    merged = setting.merged_model("task_arithmetic", {"lam": 1.0})
    flat = dict(cached)
    with setting.composed([1.0, 1.0]) as composed:
        if rollout_missing:
            task_vectors = dict(zip(setting.experts, setting.task_vectors()))
            # The composition runs on the base itself, so the input interference's adapters go onto a copy of it.
            adapters = (copy.deepcopy(setting.base), setting.experts)
            rollouts = rollout_batches(
                composed,
                batches_of([item.prompt for item in items]),
                max_new_tokens=config.rollout_tokens,
                eos_token_id=stop,
                pad_token_id=stop,
            )
            flat.update(
                unlabelled_diagnostics(composed, rollouts, merged, task_vectors, config.diagnostics, adapters=adapters)[
                    0
                ]
            )
        if own_missing:  # each expert on its own skill's validation prompts
            own = {
                skill: batches_of([i.prompt for i in skill_items(skill, "validation", len(items), config.seed)])
                for skill in setting.experts
            }
            reports = own_prompt_reports(composed, own, merged, config.diagnostics, config.rollout_tokens, stop, stop)
            flat.update(own_prompt_statistics(reports, list(setting.experts)))
    flat = {key: (None if value is None or value != value else float(value)) for key, value in flat.items()}
    atomic_write_text(path, json.dumps(flat, indent=1) + "\n")
    return flat


def work_seconds(experts: dict[str, Path], settings: list[dict]) -> dict:
    """The time each piece took when it was made, by whichever run made it (`stage_seconds` counts this run only, so
    a resumed run's are short): each expert's training (its `training.json`), each setting's cells (None for cells
    made before cells kept their time)."""
    training = {}
    for skill, folder in experts.items():
        try:
            training[skill] = json.loads((Path(folder) / "training.json").read_text(encoding="utf-8")).get("seconds")
        except (OSError, json.JSONDecodeError):
            training[skill] = None
    return {"expert_training": training, "setting_cells": {r["name"]: r.get("cell_seconds") for r in settings}}


def paper_claims(settings: list[dict]) -> dict:
    """What the settings say about the paper's two claims, whichever way it comes out.

    * `compose_beats_experts`: the settings where the chosen composition's joint test accuracy is above each
      expert's alone, of all settings, and the least margin over the better expert (points, may be negative);
    * `merge_compose_kl`: Spearman ρ (scipy) of `merge_compose_kl` against |best composition − best merge| across
      settings, and the mean |compose − merge| where the KL is at or below its median, and above it;
    * `labels`: how many settings got each label.
    """
    margins = []
    for record in settings:
        test, compose = record["test"], record["chosen"]["compose"]["system"]
        best_expert = max(test[f"expert:{skill}"]["accuracy"] for skill in record["skills"])
        margins.append(test[compose]["accuracy"] - best_expert)
    claims: dict = {
        "compose_beats_experts": {
            "settings": sum(margin > 0 for margin in margins),
            "of": len(settings),
            "least_margin_points": round(100 * min(margins), 1) if margins else None,
        },
        "labels": {label: sum(r["outcome"]["label"] == label for r in settings) for label in OUTCOMES},
    }
    pairs = [
        (r["diagnostics"]["merge_compose_kl"], abs(r["compose_minus_merge"]))
        for r in settings
        if r["diagnostics"].get("merge_compose_kl") is not None
    ]
    if len(pairs) >= 3:
        kl, gap = (np.array(column, dtype=float) for column in zip(*pairs))
        rho = spearmanr(kl, gap)
        low = kl <= np.median(kl)
        claims["merge_compose_kl"] = {
            "rho_abs_gap": None if np.isnan(rho.statistic) else float(rho.statistic),
            "p": None if np.isnan(rho.pvalue) else float(rho.pvalue),
            "n": len(pairs),
            "abs_gap_points_low_kl": float(100 * gap[low].mean()),
            "abs_gap_points_high_kl": float(100 * gap[~low].mean()) if (~low).any() else None,
            "median_kl": float(np.median(kl)),
        }
    return claims


def results_markdown(results: dict) -> str:
    """The bars, then one row per setting: its label, the test accuracies, and a few diagnostics."""
    plot = f"\n![every diagnostic against best composition − best merge]({GAP_PLOT})\n"
    return f"# {results['name']}\n\n" + real_settings_table(results) + claims_markdown(results["claims"]) + plot


def claims_markdown(claims: dict) -> str:
    """The paper's two claims, as the settings answer them."""
    beats = claims["compose_beats_experts"]
    lines = [
        "",
        "## The paper's claims at this scale",
        "",
        f"- Composition beats each expert alone on the joint split in {beats['settings']} of {beats['of']} settings "
        f"(least margin over the better expert: {beats['least_margin_points']} points).",
        "- Labels: " + ", ".join(f"{label} {count}" for label, count in claims["labels"].items()) + ".",
    ]
    kl = claims.get("merge_compose_kl")
    if kl:
        lines.append(
            f"- merge_compose_kl against |compose − merge|: Spearman ρ = {_number(kl['rho_abs_gap'])} "
            f"(p = {_number(kl['p'])}, n = {kl['n']}); mean |compose − merge| {kl['abs_gap_points_low_kl']:.1f} points "
            f"where the KL ≤ its median {kl['median_kl']:.3g}, {_number(kl['abs_gap_points_high_kl'])} points above."
        )
    return "\n".join(lines) + "\n"


def real_settings_table(results: dict) -> str:
    """The experts' bars and the settings' table, as markdown."""
    lines = ["## Experts", ""]
    rows = [
        [
            skill,
            _pct(s["base"]["lenient"]),
            _pct(s["base"]["strict"]),
            _pct(s["expert"]["lenient"]),
            _pct(s["expert"]["strict"]),
        ]
        for skill, s in results["bars"].items()
    ]
    lines.append(markdown_table(["skill", "base lenient", "base strict", "expert lenient", "expert strict"], rows))
    lines += ["", "## Settings (joint test split, lenient)", ""]
    rows = []
    for record in results["settings"]:
        test, chosen, outcome = record["test"], record["chosen"], record["outcome"]
        first, second = record["skills"]
        rows.append(
            [
                record["name"],
                outcome["label"],
                f"{outcome['p_value']:.3g}",
                _pct(test["base"]["accuracy"]),
                _pct(test[f"expert:{first}"]["accuracy"]),
                _pct(test[f"expert:{second}"]["accuracy"]),
                f"{chosen['merge']['system']} {_pct(test[chosen['merge']['system']]['accuracy'])}",
                f"{chosen['compose']['system']} {_pct(test[chosen['compose']['system']]['accuracy'])}",
                _number(record["diagnostics"].get("merge_compose_kl")),
                _number(record["diagnostics"].get("top1_shift_rate_mean")),
            ]
        )
    header = [
        "setting",
        "label",
        "p",
        "base",
        "expert 1",
        "expert 2",
        "best merge",
        "best composition",
        "merge_compose_kl",
        "top1_shift_rate_mean",
    ]
    lines.append(markdown_table(header, rows))
    return "\n".join(lines) + "\n"


def _pct(value: float) -> str:
    return f"{100 * value:.1f}"


def _number(value) -> str:
    return "–" if value is None else f"{value:.3g}"
