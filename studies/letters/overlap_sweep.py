"""The claim the toolkit exists to test: does output-space overlap predict when composition fails?

A sweep over pairs of letter-replacement experts whose rules overlap from not at all (`ab` + `cd`)
to fully (`ab` + `ac`). The base and every expert are trained once, as `mergecompose compare` trains
them (`mergecompose.experiments.trained_models`, cached by hash under `DIR/checkpoints`); for each pair:

* the diagnostics (`mergecompose.studies.letters.overlap.measure_letter_pair`), teacher-forced on held-out strings
  where both skills are active, with the median centre and the base-weighted median centre;
* the composed model's joint-task accuracy, by real greedy decoding: an output is correct when
  it has the right length and every character is one the pair allows (the joint target; where
  the two maps conflict, either letter);
* the best merge's accuracy: every (method, λ, density) of `merges` is tried on a validation
  set of the pair's strings; the best one is scored on the test strings.

Across pairs: the Spearman correlation of overlap with composition error (and with merge
error), a scatter plot, and the 2×2 table of overlap low/high × linearization error low/high
against composition and merge success. The pair's linearization error is its merge-vs-compose
gap `KL(q ‖ m)` at λ = 1: the deviation from `z(θ_b+τ_a+τ_b) = z_b + Δz_a + Δz_b`.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from tqdm.auto import tqdm

from mergecompose.analysis.overlap_report import format_number
from mergecompose.analysis.streaming import OverlapSettings
from mergecompose.composition import ComposedLM
from mergecompose.core.io import markdown_table, read_yaml_mapping, validation_message
from mergecompose.experiments.compare_config import (
    CompareConfig,
    MergeGrid,
    check_some_merge_grids,
    deep_merge,
    fingerprint,
)
from mergecompose.experiments.evaluate import EvalSet, greedy_outputs
from mergecompose.experiments.merge_selection import best_record, merged_model, search_merges
from mergecompose.experiments.run_folder import FolderLayout, RunFolder
from mergecompose.experiments.scored_systems import ComposedModel, ScoredModel, SingleModel, System, merge_name
from mergecompose.experiments.trained_models import prepare_components
from mergecompose.studies.letters.overlap import measure_letter_pair, pair_replacements, pair_strings
from mergecompose.studies.letters.overlap_sweep_stats import plot_overlap_against_error, spearman, two_by_two

# Any folder is accepted (a sweep folder holds what its user puts there); sweep.json records the config.
SWEEP_FOLDER = FolderLayout(
    "an overlap-sweep folder",
    results="sweep.json",
    own_entries_only=False,
    other_config="{folder} holds a sweep of another config (hash {previous}); pass overwrite=True",
)


def _default_merges() -> dict[str, MergeGrid]:
    return {
        "task_arithmetic": MergeGrid(lam=[0.5, 0.75, 1.0, 1.25]),
        "ties": MergeGrid(lam=[0.75, 1.0, 1.25, 1.5], density=[0.2, 0.5]),
    }


class SweepConfig(BaseModel):
    """An overlap sweep on the letter task.

    * `compare`: a `mergecompose compare` YAML (e.g. configs/letters.yaml) giving the task
      formulation, model, positions and training recipe; its skills are replaced by `skills`,
      LoRA training is dropped (the sweep uses full fine-tunes).
    * `skills`: name -> {source: replacement}; `pairs`: the expert pairs, by skill name.
    * `test_strings`, `validation_strings`: held-out strings per pair (both skills active).
    * `success_threshold`: a system succeeds on a pair when its joint accuracy is ≥ this.
    * `compare_overrides`: values merged (recursively) into the compare YAML before it is
      validated, e.g. `{training: {experts: {full: {steps: 25}}}}` for under-trained experts.

    A relative `compare` path is read from the sweep config's own folder (`config_path` of
    `compare_config`, `preflight_overlap_sweep` and `run_sweep`).
    """

    model_config = ConfigDict(extra="forbid")

    name: str = "overlap_sweep"
    compare: str
    compare_overrides: dict = Field(default_factory=dict)
    skills: dict[str, dict[str, str]]
    pairs: list[tuple[str, str]] = Field(min_length=1)
    test_strings: int = Field(300, ge=1)
    validation_strings: int = Field(100, ge=1)
    merges: dict[str, MergeGrid] = Field(default_factory=_default_merges)
    success_threshold: float = Field(0.9, ge=0, le=1)
    settings: OverlapSettings = Field(default_factory=OverlapSettings)
    seed: int = 0

    @field_validator("merges")
    @classmethod
    def _known_methods(cls, value):
        return check_some_merge_grids(value)

    @model_validator(mode="after")
    def _pairs_name_skills(self):
        for a, b in self.pairs:
            for name in (a, b):
                if name not in self.skills:
                    raise ValueError(
                        f"pair ({a!r}, {b!r}) names skill {name!r}, which `skills` does not define; "
                        f"skills: {sorted(self.skills)}"
                    )
            if a == b:
                raise ValueError(f"pair ({a!r}, {b!r}) repeats one skill; give two skills (they may share a map)")
        return self

    def compare_config(self, config_path: str | os.PathLike | None = None) -> CompareConfig:
        """The compare config that trains the base and every skill (validated by `experiments.compare_config`).

        A relative `compare` is read from the folder of `config_path` (the sweep config's file; None: the
        working directory)."""
        compare = relative_to_config(self.compare, config_path)
        data = deep_merge(read_yaml_mapping(compare, "`compare` config"), self.compare_overrides)
        data["task"] = {**data.get("task", {}), "skills": self.skills, "joint": list(self._compatible_pair())}
        training = data.get("training")
        if not isinstance(training, dict) or not isinstance(training.get("experts"), dict):
            raise ValueError(
                f"`compare` config {str(compare)!r} (with `compare_overrides`) has no `training.experts` block; "
                "the sweep trains its base and experts: give `training` in the compare config or the overrides"
            )
        training["experts"] = {k: v for k, v in training["experts"].items() if k != "lora"}
        data["merges"] = {}
        try:
            return CompareConfig.model_validate(data)
        except ValidationError as error:
            raise ValueError(f"`compare` config {str(compare)!r}: {validation_message(error)}") from None

    def _compatible_pair(self) -> tuple[str, str]:
        # The compare config's LetterTask needs a non-conflicting joint pair; it only shapes its own splits.
        for a, b in self.pairs:
            if not pair_replacements(self.skills[a], self.skills[b])[1]:
                return a, b
        raise ValueError("`pairs` must include at least one pair whose maps do not conflict")


def relative_to_config(path: str | os.PathLike, config_path: str | os.PathLike | None) -> Path:
    """`path` named inside the config file `config_path`: a relative one is read from that file's folder."""
    resolved = Path(path).expanduser()
    if resolved.is_absolute() or config_path is None:
        return resolved
    return Path(config_path).parent / resolved


def preflight_overlap_sweep(config: SweepConfig, config_path: str | os.PathLike | None = None) -> None:
    """Check everything `run_sweep` needs before any training; load no model, write nothing.

    The compare config (read from the folder of `config_path`, the sweep config's file) loads and
    validates with `compare_overrides`, the sweep's skills and no LoRA; its formulation is seq2seq (the
    sweep decodes greedily). The pairs, skills, merge grids and overlap settings are checked by
    `SweepConfig` itself.
    """
    compare = config.compare_config(config_path)
    if compare.task.formulation != "seq2seq":
        raise ValueError(
            f"the sweep decodes greedily and needs the seq2seq formulation, got {compare.task.formulation!r}"
        )


def conflict_choices(
    outputs: list[str], sources: list[str], replace_a: dict[str, str], replace_b: dict[str, str]
) -> dict:
    """Where the two maps conflict: how often each output letter was written, over all such positions."""
    _, conflicts = pair_replacements(replace_a, replace_b)
    counts: dict[str, int] = {}
    for output, text in zip(outputs, sources):
        for position, character in enumerate(text):
            if character in conflicts:
                written = output[position] if position < len(output) else "<none>"
                counts[written] = counts.get(written, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def allowed_outputs(text: str, replace_a: dict[str, str], replace_b: dict[str, str]) -> list[set[str]]:
    """Per character of `text`, the output letters the pair allows: the joint target, either letter on a conflict."""
    prefix_map, conflicts = pair_replacements(replace_a, replace_b)
    return [conflicts.get(c, {prefix_map.get(c, c)}) for c in text]


def joint_rights(
    outputs: list[str], sources: list[str], replace_a: dict[str, str], replace_b: dict[str, str]
) -> list[bool]:
    """Per output: of the right length, and every character allowed (`allowed_outputs`)."""
    rights = []
    for output, text in zip(outputs, sources, strict=True):
        allowed = allowed_outputs(text, replace_a, replace_b)
        rights.append(len(output) == len(text) and all(c in ok for c, ok in zip(output, allowed)))
    return rights


def joint_accuracy(
    outputs: list[str], sources: list[str], replace_a: dict[str, str], replace_b: dict[str, str]
) -> float:
    """Share of outputs of the right length whose every character is allowed (`joint_rights`)."""
    return sum(joint_rights(outputs, sources, replace_a, replace_b)) / len(sources)


def greedy_pair_outputs(model: ScoredModel, sources, fmt, tokenizer, batch_size) -> list[str]:
    """`model`'s greedy outputs on letter strings of one length (`mergecompose.experiments.evaluate.greedy_outputs`)."""
    eval_set = EvalSet("pair", len(sources[0]), tuple(sources), tuple(sources))
    return greedy_outputs(model, eval_set, fmt, tokenizer, batch_size)


def run_sweep(
    config: SweepConfig,
    out_dir: str | os.PathLike,
    overwrite: bool = False,
    progress: bool = True,
    config_path: str | os.PathLike | None = None,
) -> dict:
    """Train (or load) every expert, measure every pair, write sweep.json, sweep.md, overlap_vs_error.png, config.yaml.

    `config_path`: the sweep config's file, whose folder a relative `compare` is read from (None: the
    working directory). `preflight_overlap_sweep` runs first. `out_dir/checkpoints` is kept between runs
    (reused by hash). Results of another config in `out_dir` are refused unless `overwrite`; a folder
    that another run is writing is refused at once.
    """
    preflight_overlap_sweep(config, config_path)
    run = RunFolder(out_dir, SWEEP_FOLDER)
    compare = config.compare_config(config_path)
    config_hash = fingerprint(config.model_dump(mode="json"), compare)
    with run.claim(config_hash, overwrite):
        return _run_sweep_claimed(config, compare, config_hash, run, progress)


def _run_sweep_claimed(
    config: SweepConfig, compare: CompareConfig, config_hash: str, run: RunFolder, progress: bool
) -> dict:
    components = prepare_components(compare, run.path, progress)
    task = compare.task.letter_task()
    fmt, tokenizer = components.format, components.tokenizer
    batch_size, length = compare.evaluation.batch_size, compare.eval_length
    base = components.load_base()
    experts = {name: components.load_expert(name) for name in sorted({n for pair in config.pairs for n in pair})}

    def outputs(model: ScoredModel, sources: list[str]) -> list[str]:
        return greedy_pair_outputs(model, sources, fmt, tokenizer, batch_size)

    rows, pairs = [], {}
    for index, (name_a, name_b) in enumerate(tqdm(config.pairs, desc="pairs", disable=not progress)):
        replace_a, replace_b = config.skills[name_a], config.skills[name_b]
        seed = config.seed + 1000 * index
        test = pair_strings(task, name_a, name_b, length, config.test_strings, seed)
        validation = pair_strings(task, name_a, name_b, length, config.validation_strings, seed + 1, exclude=test)
        pair_experts = {name_a: experts[name_a], name_b: experts[name_b]}

        diagnostics = {
            centre: measure_letter_pair(
                base,
                pair_experts,
                config.skills,
                fmt,
                tokenizer,
                test,
                settings=config.settings.model_copy(update={"centre": centre}),
                batch_size=batch_size,
                rollouts=centre == config.settings.centre,
            )
            for centre in ("median", "base_weighted_median")
        }
        composed = ComposedLM(base, [experts[name_a], experts[name_b]], names=[name_a, name_b])
        compose_outputs = outputs(ComposedModel(composed), test)
        compose_accuracy = joint_accuracy(compose_outputs, test, replace_a, replace_b)
        own = {
            name: joint_accuracy(outputs(SingleModel(experts[name]), test), test, rule, rule)
            for name, rule in ((name_a, replace_a), (name_b, replace_b))
        }

        pair_models = [experts[name_a], experts[name_b]]
        best, candidates = _best_merge(base, pair_models, config, validation, (replace_a, replace_b), outputs)
        best_model = merged_model(base, pair_models, best["method"], best["params"], seed=0)
        merge_outputs = outputs(SingleModel(best_model), test)
        merge_accuracy = joint_accuracy(merge_outputs, test, replace_a, replace_b)

        key = f"{name_a}+{name_b}"
        pairs[key] = {
            "skills": {name_a: replace_a, name_b: replace_b},
            "compose_accuracy": compose_accuracy,
            "merge_accuracy": merge_accuracy,
            "merge_chosen": {"method": best["method"], **best["params"], "validation": best["score"]},
            "merge_validation": [{"method": c["method"], **c["params"], "validation": c["score"]} for c in candidates],
            "expert_own_skill_accuracy": own,
            "conflict_choices": {
                "compose": conflict_choices(compose_outputs, test, replace_a, replace_b),
                "merge": conflict_choices(merge_outputs, test, replace_a, replace_b),
            },
            "examples": [
                {"source": text, "compose": c, "merge": m}
                for text, c, m in list(zip(test, compose_outputs, merge_outputs))[:5]
            ],
            "diagnostics": diagnostics,
        }
        rows.append(_row(key, name_a, name_b, pairs[key]))

    results = {
        "config": config.model_dump(mode="json"),
        "config_hash": config_hash,
        "compare_config": compare.model_dump(mode="json"),
        "rows": rows,
        "pairs": pairs,
        "statistics": _statistics(rows, config.success_threshold),
        "training": components.training,
        "seconds": run.elapsed(digits=1),
    }
    _write(run, results, config)
    return results


def _best_merge(base, models: list, config: SweepConfig, validation: list[str], rules: tuple, outputs) -> tuple:
    """The best merge of the pair on `validation` (joint accuracy; the first on ties), and every candidate's record."""

    def merge_system(method: str, params: dict) -> System:
        return System(merge_name(method, params), lambda: SingleModel(merged_model(base, models, method, params, 0)))

    def validation_accuracy(system: System) -> float:
        return joint_accuracy(outputs(system.load(), validation), validation, *rules)

    grids = {method: grid.candidates() for method, grid in config.merges.items()}
    candidates = search_merges(grids, merge_system, validation_accuracy, progress=False)
    return best_record(candidates), candidates


def _row(key: str, name_a: str, name_b: str, record: dict) -> dict:
    """One flat row per pair: the measures the statistics use."""
    row = {"pair": key, "conflict": bool(record["diagnostics"]["median"]["conflicting_letters"])}
    for centre, suffix in (("median", ""), ("base_weighted_median", "_weighted")):
        report = record["diagnostics"][centre]["teacher_forced"]
        pair = report["pairs"][f"{name_a}|{name_b}"]
        row[f"mass_overlap{suffix}"] = pair["mass_overlap"]
        row[f"sign_conflict{suffix}"] = pair["sign_conflict"]
        row[f"support_jaccard{suffix}"] = pair["support_jaccard"]
    report = record["diagnostics"]["median"]["teacher_forced"]
    pair = report["pairs"][f"{name_a}|{name_b}"]
    row.update(
        coactivation_rate=report["coactivation_rate"],
        projective_error=report["projective_error"]["single_active"],
        projective_error_active=max((e["projective_error_active"] or 0.0) for e in report["experts"].values()),
        linearization_error=report["merge_compose_gap"]["kl_mean"],
        top1_agreement=report["merge_compose_gap"]["top1_agreement"],
        interaction_residual_relative=report["merge_compose_gap"].get("interaction_residual_relative"),
        parameter_cosine=pair["parameter"]["cosine"],
        ties_sign_conflict=pair["parameter"]["ties_sign_conflict"],
        trimmed_mask_jaccard=pair["parameter"]["trimmed_mask_jaccard"],
        compose_accuracy=record["compose_accuracy"],
        merge_accuracy=record["merge_accuracy"],
        compose_error=1 - record["compose_accuracy"],
        merge_error=1 - record["merge_accuracy"],
        merge_method=record["merge_chosen"]["method"],
        experts_own_min=min(record["expert_own_skill_accuracy"].values()),
    )
    return row


def _statistics(rows: list[dict], success_threshold: float) -> dict:
    correlations = {
        f"{x} vs {y}": spearman(rows, x, y)
        for x, y in [
            ("mass_overlap", "compose_error"),
            ("mass_overlap_weighted", "compose_error"),
            ("sign_conflict", "compose_error"),
            ("coactivation_rate", "compose_error"),
            ("projective_error", "compose_error"),
            ("mass_overlap", "merge_error"),
            ("mass_overlap_weighted", "merge_error"),
            ("linearization_error", "merge_error"),
            ("trimmed_mask_jaccard", "mass_overlap"),
            ("parameter_cosine", "mass_overlap"),
            ("ties_sign_conflict", "sign_conflict"),
        ]
    }
    return {
        "spearman": correlations,
        "two_by_two": two_by_two(
            rows, "mass_overlap", "linearization_error", "compose_accuracy", "merge_accuracy", success_threshold
        ),
        "two_by_two_weighted": two_by_two(
            rows,
            "mass_overlap_weighted",
            "linearization_error",
            "compose_accuracy",
            "merge_accuracy",
            success_threshold,
        ),
    }


def _write(run: RunFolder, results: dict, config: SweepConfig) -> None:
    run.write_json("sweep.json", results, finite=True)
    run.write_text("sweep.md", sweep_markdown(results))
    run.write_config(config)
    errors = {"composition": "compose_error", "best merge": "merge_error"}
    for x_key, file in (
        ("mass_overlap", "overlap_vs_error.png"),
        ("mass_overlap_weighted", "overlap_weighted_vs_error.png"),
    ):
        rho = {
            kind: results["statistics"]["spearman"][f"{x_key} vs {kind}_error"]["rho"] for kind in ("compose", "merge")
        }
        shown = {kind: "undefined" if value is None else f"{value:.2f}" for kind, value in rho.items()}
        title = f"{x_key} against joint-task error; Spearman ρ: composition {shown['compose']}, merge {shown['merge']}"
        run.write_figure(
            file, functools.partial(plot_overlap_against_error, results["rows"], x_key, errors, title=title)
        )


def sweep_markdown(results: dict) -> str:
    """sweep.md: the per-pair table, the correlations and the 2×2 tables."""

    columns = [
        ("pair", "pair"),
        ("conflict", "conflict"),
        ("O (median)", "mass_overlap"),
        ("O (weighted)", "mass_overlap_weighted"),
        ("sign conflict", "sign_conflict"),
        ("co-active", "coactivation_rate"),
        ("proj. err.", "projective_error"),
        ("KL(q‖m)", "linearization_error"),
        ("cos τ", "parameter_cosine"),
        ("TIES conflict", "ties_sign_conflict"),
        ("mask Jaccard", "trimmed_mask_jaccard"),
        ("experts own", "experts_own_min"),
        ("compose acc.", "compose_accuracy"),
        ("merge acc.", "merge_accuracy"),
        ("merge", "merge_method"),
    ]
    lines = [
        f"# Overlap sweep: {results['config']['name']}",
        "",
        f"{len(results['rows'])} pairs; {results['seconds']} s.",
        "",
    ]
    lines += markdown_table(
        [c for c, _ in columns], [[row[key] for _, key in columns] for row in results["rows"]], cell=format_number
    ).splitlines()
    lines += ["", "## Spearman correlations", ""]
    lines += markdown_table(
        ["x vs y", "ρ", "p", "n"],
        [[name, c["rho"], c["p_value"], c["n"]] for name, c in results["statistics"]["spearman"].items()],
        cell=format_number,
    ).splitlines()
    for key, title in (("two_by_two", "median centre"), ("two_by_two_weighted", "base-weighted median centre")):
        table = results["statistics"][key]
        lines += [
            "",
            f"## 2×2: overlap ({title}) × linearization error KL(q‖m), "
            f"against success (accuracy ≥ {table['success_threshold']})",
            "",
            f"Splits at the medians: overlap {format_number(table['overlap_split'])}, "
            f"linearization {format_number(table['linearization_split'])}.",
            "",
        ]
        lines += markdown_table(
            ["cell", "n", "compose success", "merge success", "compose acc. mean", "merge acc. mean", "pairs"],
            [
                [
                    cell,
                    c["n"],
                    c["compose_success"],
                    c["merge_success"],
                    c["compose_accuracy_mean"],
                    c["merge_accuracy_mean"],
                    ", ".join(c["pairs"]),
                ]
                for cell, c in table["cells"].items()
            ],
            cell=format_number,
        ).splitlines()
    choices = {
        key: record["conflict_choices"]
        for key, record in results["pairs"].items()
        if record["conflict_choices"]["compose"]
    }
    if choices:
        lines += ["", "## Conflicting letters: what each system wrote there", ""]
        for key, record in choices.items():
            lines.append(f"- **{key}**: compose {record['compose']}, merge {record['merge']}")
    lines.append("")
    return "\n".join(lines)
