"""The predict-sweep's config: families of settings, each built from a `mergecompose compare` config.

A family is one compare YAML (letters or skills) with overrides; its settings are the expert
sets composed from it: letter pairs (`pair: [ab, cd]`) or the first k skills (`k: 3`, optionally
with `expert_noise`). Every component is trained once, cached by hash under `OUT/checkpoints`,
and shared by every setting (and family) whose recipe it matches.

A relative `compare:` path is read from the predict config's own folder (`config_path`), so the
shipped configs/predict.yaml names `letters.yaml`, and the sweep runs from any working directory.
`preflight_predict` validates every family and setting, each compare config included, before any work.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from mergecompose.analysis.streaming import OverlapSettings
from mergecompose.composition.remedies import RemedySettings
from mergecompose.core.executor import ResourcesConfig
from mergecompose.core.io import StrictModel, read_yaml_mapping, validation_message
from mergecompose.experiments.compare_config import CompareConfig, MergeGrid, check_some_merge_grids, deep_merge
from mergecompose.studies.letters.letters_task_type import LettersTaskSettings
from mergecompose.studies.letters.overlap import pair_replacements
from mergecompose.studies.letters.overlap_sweep import relative_to_config
from mergecompose.studies.skills.skills_task_type import SkillsTaskSettings

# Bump when what a setting's results mean changes: the cached per-setting results are keyed by it.
SWEEP_VERSION = 2  # 2: the paired label (`paired`), with each item's right/wrong


class SettingSpec(StrictModel):
    """One expert set: a letter `pair`, or the first `k` skills (with `expert_noise` on the full experts)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.+-]+$")
    pair: tuple[str, str] | None = None
    k: int | None = Field(None, ge=2)
    expert_noise: float = Field(0.0, ge=0)


class FamilySpec(StrictModel):
    """Settings that share a compare config (`compare` + `overrides`) and an expert kind.

    * `experts`: "full" fine-tunes, or "lora" adapters composed on one base copy (merged through
      their dense ΔW).
    * `letter_skills`: the letter family's skills (name → {source: replacement}); replaces the
      compare config's.
    """

    compare: str
    overrides: dict = Field(default_factory=dict)
    experts: Literal["full", "lora"] = "full"
    letter_skills: dict[str, dict[str, str]] | None = None
    settings: list[SettingSpec] = Field(min_length=1)


def _default_merges() -> dict[str, MergeGrid]:
    return {"task_arithmetic": MergeGrid(lam=[0.5, 0.75, 1.0]), "ties": MergeGrid(lam=[0.75, 1.0, 1.25], density=[0.5])}


class PredictConfig(StrictModel):
    """`mergecompose predict-sweep CONFIG --out DIR`.

    * `test_size`: joint-task inputs scored per setting (exact match, gold targets);
      `validation_size`: inputs on which each merge's hyperparameters are chosen;
      `diagnostic_prompts`: unlabelled joint-task inputs whose composed rollouts give the diagnostics.
    * `remedies`: the composition's remedy sets (`compose+<name>`); the best one is `best_remedy`.
    * `success_threshold`: a system succeeds at exact match ≥ this.
    * `bootstrap`: resamples of the settings for the correlations' 95 % intervals.
    """

    name: str = "predict"
    families: dict[str, FamilySpec] = Field(min_length=1)
    test_size: int = Field(300, ge=1)
    validation_size: int = Field(100, ge=1)
    diagnostic_prompts: int = Field(64, ge=1)
    merges: dict[str, MergeGrid] = Field(default_factory=_default_merges)
    remedies: dict[str, RemedySettings] = Field(default_factory=lambda: {"gate": RemedySettings(gate=0.1)})
    success_threshold: float = Field(0.9, ge=0, le=1)
    overlap: OverlapSettings = Field(default_factory=OverlapSettings)
    bootstrap: int = Field(2000, ge=100)
    batch_size: int = Field(256, ge=1)
    seed: int = 0
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)

    @field_validator("merges")
    @classmethod
    def _known_methods(cls, value):
        return check_some_merge_grids(value)

    @field_validator("remedies")
    @classmethod
    def _some_remedy(cls, value):
        if not value:
            raise ValueError("`remedies` must name at least one remedy set, e.g. {gate: {gate: 0.1}}")
        return value

    @model_validator(mode="after")
    def _unique_names(self):
        names = [setting.name for family in self.families.values() for setting in family.settings]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(
                f"setting names must be unique across families (each names a results file), repeated: {repeated}"
            )
        return self

    def compare_config(self, family_name: str, config_path: str | os.PathLike | None = None) -> CompareConfig:
        """The family's compare config, validated (and each of its settings checked against it).

        A relative `compare` path is read from the folder of `config_path` (this config's file; None: the
        working directory)."""
        family = self.families[family_name]
        compare = relative_to_config(family.compare, config_path)
        data = deep_merge(read_yaml_mapping(compare, f"family {family_name!r}: `compare` config"), family.overrides)
        data["name"] = family_name
        data["merges"], data["remedies"], data["variants"] = {}, {}, {}
        training = data.get("training")
        if not isinstance(training, dict) or not isinstance(training.get("experts"), dict):
            raise ValueError(
                f"family {family_name!r}: its compare config {str(compare)!r} (with `overrides`) has no "
                "`training.experts` block; a predict family trains its base and experts: give `training` "
                "(base and experts) in the compare config or in the family's `overrides`"
            )
        experts = training["experts"]
        if family.experts == "full":
            training["experts"] = {k: v for k, v in experts.items() if k not in ("lora", "lora_per_skill")}
        elif experts.get("lora") is None:
            raise ValueError(
                f"family {family_name!r}: `experts: lora` needs `training.experts.lora` in its compare config"
            )
        task = data.get("task", {})
        if task.get("type", "letters") == "letters":
            if family.letter_skills is None:
                raise ValueError(f"family {family_name!r}: a letters family needs `letter_skills`")
            task["skills"] = family.letter_skills
            task["joint"] = list(_compatible_pair(family_name, family))
        elif family.letter_skills is not None:
            raise ValueError(
                f"family {family_name!r}: `letter_skills` is for letters families, "
                f"the compare config is {task.get('type')!r}"
            )
        else:
            available = len(task.get("skills", []))
            for setting in family.settings:
                if _k(family_name, setting) > available:
                    raise ValueError(
                        f"family {family_name!r}, setting {setting.name!r}: `k` = {setting.k} but the compare "
                        f"config lists {available} skills"
                    )
            task["num_experts"] = max(setting.k for setting in family.settings)
        data["task"] = task
        try:
            config = CompareConfig.model_validate(data)
        except ValidationError as error:
            raise ValueError(f"family {family_name!r}: {validation_message(error)}") from None
        if config.task.formulation != "seq2seq":
            raise ValueError(
                f"family {family_name!r}: the sweep decodes prompts and needs the seq2seq formulation, "
                f"got {config.task.formulation!r}"
            )
        for setting in family.settings:
            _check_setting(family_name, config, setting)
        return config

    def setting_config(
        self, family_name: str, setting: SettingSpec, config_path: str | os.PathLike | None = None
    ) -> CompareConfig:
        """For a skills setting, the family's config with its k and noise (components are shared across k)."""
        config = self.compare_config(family_name, config_path)
        if not isinstance(config.task, SkillsTaskSettings):
            return config
        data = config.model_dump(mode="json")
        data["task"]["num_experts"] = setting.k
        data["task"]["expert_noise"] = setting.expert_noise
        return CompareConfig.model_validate(data)


def preflight_predict(config: PredictConfig, config_path: str | os.PathLike | None = None) -> None:
    """Check everything `run_predict_sweep` needs before any training; load no model, write nothing.

    Every family's compare config (read from the folder of `config_path`, the predict config's file)
    loads and validates with the family's overrides, and every setting's own config (its `k` and
    `expert_noise`) validates against it; the merge methods, remedies and overlap settings are
    checked by `PredictConfig` itself.
    """
    for family_name, family in config.families.items():
        config.compare_config(family_name, config_path)
        for setting in family.settings:
            try:
                config.setting_config(family_name, setting, config_path)
            except ValidationError as error:
                raise ValueError(
                    f"family {family_name!r}, setting {setting.name!r}: {validation_message(error)}"
                ) from None


def _k(family_name: str, setting: SettingSpec) -> int:
    if setting.k is None:
        raise ValueError(f"family {family_name!r}, setting {setting.name!r}: a skills setting needs `k`")
    return setting.k


def _compatible_pair(family_name: str, family: FamilySpec) -> tuple[str, str]:
    # LetterTask's own splits need a non-conflicting joint pair; the sweep scores each pair itself.
    for setting in family.settings:
        if setting.pair is not None and all(name in family.letter_skills for name in setting.pair):
            a, b = setting.pair
            if not pair_replacements(family.letter_skills[a], family.letter_skills[b])[1]:
                return a, b
    raise ValueError(
        f"family {family_name!r}: at least one `pair` must name two `letter_skills` whose maps do not conflict"
    )


def _check_setting(family_name: str, config: CompareConfig, setting: SettingSpec) -> None:
    where = f"family {family_name!r}, setting {setting.name!r}"
    if isinstance(config.task, LettersTaskSettings):
        if setting.pair is None or setting.k is not None or setting.expert_noise:
            raise ValueError(
                f"{where}: a letters setting gives `pair` (two skill names) and neither `k` nor `expert_noise`"
            )
        a, b = setting.pair
        for name in (a, b):
            if name not in config.task.skills:
                raise ValueError(
                    f"{where}: `pair` names {name!r}, which `letter_skills` does not define; "
                    f"valid: {sorted(config.task.skills)}"
                )
        if a == b:
            raise ValueError(f"{where}: `pair` repeats {a!r}; give two skills (they may share a map)")
        return
    if setting.pair is not None:
        raise ValueError(f"{where}: a skills setting gives `k`, not `pair`")
