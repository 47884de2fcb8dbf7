"""`mergecompose predict-sweep`: "should I merge or compose these experts?", across settings where each fails.

For every setting (an expert set from one of the families of `PredictConfig`):

* **diagnostics, unlabelled**: prompts drawn from the joint task's inputs (no targets), the
  composed model's own greedy rollouts from them, and on those every statistic of
  `mergecompose.analysis.predict.unlabelled_diagnostics` (both centres, the merge–compose gap against the
  task-arithmetic merge at λ = 1, the parameter-space measures, the proxy-owner statistics);
* **outcomes, labelled**: exact match on held-out joint inputs of plain composition, of each
  remedy (the best is `best_remedy`), of the best merge (every grid point of `merges` scored on a
  validation set, the best one on the test set), and of each expert on its own skill;
* **the paired label** (`mergecompose.analysis.paired_outcome`, the same as the real settings'): the best
  merge against the best composition (plain or a remedy, chosen on the validation inputs) on the same test
  inputs, exact McNemar: "merge", "compose" or "either"; each system's right/wrong per test input is kept.

Each setting's record is written to `OUT/settings/<name>.json` as soon as it is done, keyed by a
hash of everything it depends on, so an interrupted sweep resumes where it stopped and a
changed setting is measured again; a record that lacks one of today's diagnostics (measured before it was added)
has only its diagnostics measured again (`setting_diagnostics`), not its systems. Components are trained once into
`OUT/checkpoints`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from pathlib import Path

import torch

from mergecompose.analysis.measure import rollout_batches
from mergecompose.analysis.paired_outcome import paired_outcome
from mergecompose.analysis.predict import diagnostic_names, unlabelled_diagnostics
from mergecompose.composition import ComposedLM
from mergecompose.core.adapters import merged_adapter_model
from mergecompose.core.executor import Cell, Executor, LocalExecutor, cell_runs, raise_if_failed, run_cells
from mergecompose.experiments.compare_config import CompareConfig, fingerprint
from mergecompose.experiments.evaluate import JOINT, score
from mergecompose.experiments.merge_selection import best_record, merged_model, search_merges
from mergecompose.experiments.run_folder import FolderLayout, RunFolder, Stopwatch
from mergecompose.experiments.scored_systems import ComposedModel, ScoredModel, SingleModel, System, merge_name
from mergecompose.experiments.trained_models import Components, prepare_components
from mergecompose.merging import TaskVector
from mergecompose.studies.letters.letters_task_type import LettersTaskSettings
from mergecompose.studies.letters.overlap import pair_strings, prompt_batches
from mergecompose.studies.letters.overlap_sweep import greedy_pair_outputs, joint_accuracy, joint_rights
from mergecompose.studies.predict.predict_config import (
    SWEEP_VERSION,
    FamilySpec,
    PredictConfig,
    SettingSpec,
    preflight_predict,
)
from mergecompose.studies.predict.predict_report import write_outputs
from mergecompose.studies.predict.stats import analyse

CACHED = ("checkpoints", "settings")  # kept between runs: trained components, measured settings
PREDICT_FOLDER = FolderLayout("a predict-sweep folder", results="predict.json", cached=CACHED, leftovers=CACHED)


def run_predict_sweep(
    config: PredictConfig,
    out_dir: str | os.PathLike,
    overwrite: bool = False,
    progress: bool = True,
    echo=print,
    config_path: str | os.PathLike | None = None,
    executor: Executor | None = None,
) -> dict:
    """Measure every setting (resuming from `OUT/settings`), then the statistics and the verdict rule.

    Writes predict.json, predict.md, predict_rule.json, config.yaml and the scatter plots.
    `config_path`: the predict config's file, whose folder relative `compare` paths are read from
    (None: the working directory). Every family and setting is validated first (`preflight_predict`),
    before any training starts. A folder that holds the results of another config is refused unless
    `overwrite`; one that another run is writing, at once. Returns the predict.json content.

    The cells (`mergecompose.core.executor`): each family's experts, trained once (`<family>/experts`), and each
    setting's measurement (`<family>/<setting>`), which waits for its family's experts and writes
    `OUT/settings/<setting>.json`. `executor`: where they run (default: here, one after another; or
    `mergecompose.integrations.ray.RayExecutor`). A cell that fails is reported and the others go on; then
    `CellsFailed` is raised, with no predict.json written, and a rerun measures only what is missing.
    """
    preflight_predict(config, config_path)
    run = RunFolder(out_dir, PREDICT_FOLDER)
    config_hash = fingerprint(config.model_dump(mode="json", exclude={"resources"}))
    with run.claim(config_hash, overwrite):
        (run.path / "settings").mkdir(parents=True, exist_ok=True)
        cells = []
        for family_name, family in config.families.items():
            if echo is not None:
                echo(f"== {family_name}: {len(family.settings)} settings")
            experts = f"{family_name}/experts"
            cells.append(
                Cell(
                    experts,
                    _family_components,
                    (config, family_name, str(run.path), config_path),
                    config.resources.train.resources(),
                )
            )
            cells += [
                Cell(
                    f"{family_name}/{setting.name}",
                    _setting_cell,
                    (config, family_name, setting.name, str(run.path), config_path),
                    config.resources.cell.resources(),
                    after=(experts,),
                )
                for setting in family.settings
            ]
        runs = run_cells(cells, executor, progress, desc="settings")
        raise_if_failed(runs)
        records = [runs[cell.name].value for cell in cells if cell.after]
        results = {
            "name": config.name,
            "version": SWEEP_VERSION,
            "config_hash": config_hash,
            "settings": records,
            **analyse(records, config),
        }
        results["seconds"] = run.elapsed(digits=1)
        results["setting_seconds"] = round(sum(record["seconds"] for record in records), 1)
        results["cells"] = {"executor": (executor or LocalExecutor()).name, "runs": cell_runs(runs)}
        write_outputs(run, results, config)
    return results


# A process's components of each family (trained, or read from the run folder's checkpoints): the local executor
# trains them once for all its settings; a Ray worker reads them once from the checkpoints the family's cell wrote.
_COMPONENTS: dict[tuple[str, str], Components] = {}


def _family_components(
    config: PredictConfig, family_name: str, run_path: str, config_path: str | os.PathLike | None
) -> Components:
    compare = config.compare_config(family_name, config_path)
    key = (fingerprint(compare.model_dump(mode="json")), run_path)
    if key not in _COMPONENTS:
        _COMPONENTS[key] = prepare_components(compare, Path(run_path), False)
    return _COMPONENTS[key]


def _setting_cell(
    config: PredictConfig, family_name: str, setting_name: str, run_path: str, config_path: str | os.PathLike | None
) -> dict:
    """One setting's record (from the run folder, or measured and written there): one cell of the sweep."""
    family = config.families[family_name]
    setting = next(setting for setting in family.settings if setting.name == setting_name)
    components = _family_components(config, family_name, run_path, config_path)
    run = RunFolder(run_path, PREDICT_FOLDER)  # the driver holds its lock; the cell writes its own file
    return _setting_record(config, family_name, family, setting, components, run, False, config_path)


def _setting_record(
    config: PredictConfig,
    family_name: str,
    family: FamilySpec,
    setting: SettingSpec,
    components: Components,
    run: RunFolder,
    progress: bool,
    config_path: str | os.PathLike | None = None,
) -> dict:
    """The setting's record: from `OUT/settings/<name>.json` where its key (a hash of its inputs) is unchanged,
    else measured now and written there. The key holds the compare config's content, not its path, so a
    moved or renamed config file measures nothing again."""
    compare = config.setting_config(family_name, setting, config_path)
    inputs = {
        "version": SWEEP_VERSION,
        "family": family.model_dump(mode="json", exclude={"settings", "compare"}),
        "setting": setting.model_dump(mode="json"),
        "compare": compare.model_dump(mode="json"),
        "checkpoints": {label: entry["fingerprint"] for label, entry in components.training.items()},
        "sizes": [config.test_size, config.validation_size, config.diagnostic_prompts, config.batch_size, config.seed],
        "merges": {k: v.model_dump(mode="json") for k, v in config.merges.items()},
        "remedies": {k: v.model_dump(mode="json") for k, v in config.remedies.items()},
        "overlap": config.overlap.model_dump(mode="json"),
    }
    key = fingerprint(inputs)
    # The setting's own variant of each expert (e.g. `expert_noise`), on the family's shared checkpoints.
    components = dataclasses.replace(components, expert_variant=compare.task.expert_variant)
    name = f"settings/{setting.name}.json"
    path = run.file(name)
    if path.is_file():
        try:
            cached = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            cached = {}
        if cached.get("key") == key:
            # Measured before a diagnostic was added: only the diagnostics are measured again, not the systems.
            if not set(diagnostic_names(config.overlap)) <= set(cached.get("diagnostics") or {}):
                cached["diagnostics"] = setting_diagnostics(config, compare, family, setting, components)
                run.write_json(name, cached, finite=True)
            return cached
    watch = Stopwatch()
    record = {"name": setting.name, "family": family_name, "key": key, "experts_kind": family.experts}
    record.update(measure_setting(config, compare, family, setting, components, progress))
    record["seconds"] = watch.elapsed(digits=1)
    run.write_json(name, record, finite=True)
    return record


class _Scorer:
    """Exact match of a system on one setting's joint task; `own` scores an expert on its own skill."""

    def __init__(self, compare: CompareConfig, setting: SettingSpec, components: Components, config: PredictConfig):
        self.fmt, self.tokenizer, self.batch_size = components.format, components.tokenizer, config.batch_size
        task = compare.task
        length = compare.eval_length
        if isinstance(task, LettersTaskSettings):
            self.letters = True
            self.names = list(setting.pair)
            letter_task = task.letter_task()
            seed = config.seed + zlib.crc32(setting.name.encode())  # each pair its own strings, stable across runs
            self.test = pair_strings(letter_task, *self.names, length, config.test_size, seed)
            self.validation = pair_strings(
                letter_task, *self.names, length, config.validation_size, seed + 1, exclude=self.test
            )
            self.prompts = pair_strings(
                letter_task,
                *self.names,
                length,
                config.diagnostic_prompts,
                seed + 2,
                exclude=set(self.test) | set(self.validation),
            )
            self.rules = {name: task.skills[name] for name in self.names}
            self.max_new_tokens = length + 2
        else:
            self.letters = False
            self.names = list(task.joint)
            evaluation = compare.evaluation.model_copy(
                update={
                    "joint_size": config.test_size,
                    "validation_size": config.validation_size,
                    "split_size": 1,
                    "lengths": [length],
                    "length_size": config.test_size,
                }
            )
            data = task.eval_data(evaluation, length, task.train_lengths[1])
            self.test_set, self.validation_set = data.test[JOINT], data.validation[JOINT]
            self.own_sets = {name: data.curves[f"skill:{name}"][length] for name in self.names}
            # Unlabelled prompts: the validation inputs' sources (never the test set, never a target).
            self.prompts = list(self.validation_set.sources[: config.diagnostic_prompts])
            self.max_new_tokens = task.max_target_length(length) + 2

    def joint_rights(self, model: ScoredModel, validation: bool = False) -> list[bool]:
        """Right or wrong on each joint input, in order (the test inputs, or the validation inputs)."""
        if self.letters:
            sources = self.validation if validation else self.test
            outputs = greedy_pair_outputs(model, sources, self.fmt, self.tokenizer, self.batch_size)
            return joint_rights(outputs, sources, *self.rules.values())
        eval_set = self.validation_set if validation else self.test_set
        return [bool(right) for right in score(model, eval_set, self.fmt, self.tokenizer, self.batch_size).correct]

    def joint(self, model: ScoredModel, validation: bool = False) -> float:
        rights = self.joint_rights(model, validation)
        return sum(rights) / len(rights)

    def own(self, name: str, model: ScoredModel) -> float:
        if self.letters:
            outputs = greedy_pair_outputs(model, self.test, self.fmt, self.tokenizer, self.batch_size)
            return joint_accuracy(outputs, self.test, self.rules[name], self.rules[name])
        return float(score(model, self.own_sets[name], self.fmt, self.tokenizer, self.batch_size).correct.mean())


def _experts(family: FamilySpec, components: Components, names: list[str]) -> tuple[list, object]:
    """The full expert models (LoRA adapters merged into copies of the base), and a factory of the composition."""
    if family.experts == "full":
        models = [components.load_expert(name) for name in names]
        return models, lambda remedies=(): ComposedLM(components.load_base(), models, names=names, remedies=remedies)
    adapters = {name: str(components.adapters[name]) for name in names}
    models = [merged_adapter_model(components.load_base(), adapters[name], "experts").eval() for name in names]
    return models, lambda remedies=(): ComposedLM.from_adapters(components.load_base(), adapters, remedies=remedies)


@torch.no_grad()
def setting_diagnostics(
    config: PredictConfig,
    compare: CompareConfig,
    family: FamilySpec,
    setting: SettingSpec,
    components: Components,
    scorer: _Scorer | None = None,
    loaded: tuple | None = None,
) -> dict:
    """The setting's unlabelled diagnostics: the composition's own rollouts from unlabelled prompts, against the
    task-arithmetic merge at λ = 1 and the experts' task vectors. `scorer` and `loaded` (the base, the experts and
    the composition) are what `measure_setting` has already built; without them they are built here."""
    scorer = scorer or _Scorer(compare, setting, components, config)
    if loaded is None:
        models, composition = _experts(family, components, scorer.names)
        loaded = (components.load_base(), models, composition())
    base, models, composed = loaded
    tokenizer = components.tokenizer
    lam_one = merged_model(base, models, "task_arithmetic", {"lam": 1.0}, seed=0)
    task_vectors = {name: TaskVector.from_models(base, model) for name, model in zip(scorer.names, models)}
    prompts = prompt_batches(components.format, tokenizer, scorer.prompts, config.batch_size, scorer.max_new_tokens)
    rolled = rollout_batches(
        composed, prompts, "composed", scorer.max_new_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id
    )
    diagnostics, _ = unlabelled_diagnostics(
        composed, rolled, merged_model=lam_one, task_vectors=task_vectors, settings=config.overlap, progress=False
    )
    return diagnostics


@torch.no_grad()
def measure_setting(
    config: PredictConfig,
    compare: CompareConfig,
    family: FamilySpec,
    setting: SettingSpec,
    components: Components,
    progress: bool = False,
) -> dict:
    """`{"experts", "diagnostics", "outcomes", "best_remedy_name", "merge_chosen", "paired"}` for one setting."""
    scorer = _Scorer(compare, setting, components, config)
    names = scorer.names
    base = components.load_base()
    models, composition = _experts(family, components, names)
    tokenizer = components.tokenizer
    composed = composition()
    diagnostics = setting_diagnostics(config, compare, family, setting, components, scorer, (base, models, composed))

    # Outcomes: exact match against the gold targets. Every composition (plain, and each remedy) is scored on
    # the test inputs and on the validation inputs: the paired label's composition is chosen on validation.
    eos = tokenizer.eos_token_id
    compositions = {"compose": composed}
    compositions.update({name: composition(remedy.build(eos)) for name, remedy in config.remedies.items()})
    test_rights = {name: scorer.joint_rights(ComposedModel(model)) for name, model in compositions.items()}
    validation = {name: scorer.joint(ComposedModel(model), validation=True) for name, model in compositions.items()}
    tested = {name: sum(rights) / len(rights) for name, rights in test_rights.items()}
    outcomes = {"compose": tested["compose"]}
    remedies = {name: tested[name] for name in config.remedies}
    best_remedy = max(remedies, key=remedies.get)

    def merge_system(method: str, params: dict) -> System:
        return System(merge_name(method, params), lambda: SingleModel(merged_model(base, models, method, params, 0)))

    grids = {method: grid.candidates() for method, grid in config.merges.items()}
    candidates = search_merges(
        grids, merge_system, lambda system: scorer.joint(system.load(), validation=True), progress=False
    )
    best = best_record(candidates)
    outcomes["best_remedy"] = remedies[best_remedy]
    merge_rights = scorer.joint_rights(SingleModel(merged_model(base, models, best["method"], best["params"], 0)))
    outcomes["best_merge"] = sum(merge_rights) / len(merge_rights)
    chosen = max(validation, key=validation.get)  # the first of the highest: plain composition, then the remedies
    paired = paired_outcome(merge_rights, test_rights[chosen])
    outcomes["experts"] = {name: scorer.own(name, SingleModel(model)) for name, model in zip(names, models)}
    outcomes["remedies"] = remedies
    return {
        "experts": names,
        "diagnostics": diagnostics,
        "outcomes": outcomes,
        "best_remedy_name": best_remedy,
        "merge_chosen": {"method": best["method"], **best["params"], "validation": best["score"]},
        "paired": {
            "composition": chosen,
            "composition_validation": validation,
            **paired.to_dict(),
            "merge_rights": merge_rights,
            "compose_rights": test_rights[chosen],
        },
    }
