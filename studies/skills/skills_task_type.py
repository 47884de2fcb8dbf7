"""The sequential-skills family as a task type of `mergecompose compare` (`task: {type: skills, ...}`).

`SkillsTaskSettings` is the `task:` block of a compare config. It gives the pipeline what the
letters task gives it, from the functions of `mergecompose.studies.skills.spec`:

* `alphabet`: the tokenizer's characters (letters, background, every marker);
* `joint` / `trained_skills()`: the k composed experts (`num_experts`), the only ones trained;
* `data_recipe()` / `skill_recipe(name)`: what shapes a checkpoint's training data, for its hash.
  It leaves out `num_experts`, so the base and expert i are the same models for every k: with
  a shared `checkpoints/` folder, the k = 6 run reuses what the k = 2 run trained;
* `training_strings(...)`: training batches (held-out strings never appear);
* `eval_data(...)`: the test and validation splits and the per-length curves.

Splits (every one scored against the joint target):

    joint            one segment of each of the k experts, at the main length
    only_<skill>     one segment of that skill only
    neither          plain text, no marker
    length_<L>       joint inputs of exactly L characters, for each L beyond training

Curves (`by_length`, each system on its own target): `copy` (the base, on training-like
inputs), `skill:<name>` (expert `name`, on inputs holding its marker pair and others at their
training rates) and `joint`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch
from pydantic import ConfigDict, Field

from mergecompose.analysis.overlap_report import plot_activity_heatmap
from mergecompose.experiments.evaluate import JOINT, EvalData, EvalSet
from mergecompose.experiments.training_strings import TrainingStrings, distinct_strings, is_held_out
from mergecompose.merging import TaskVector
from mergecompose.studies.skills.analysis import failure_section
from mergecompose.studies.skills.spec import (
    SkillsTaskSpec,
    get_transform,
    joint_target,
    length_split,
    max_segments,
    rewrite,
    sample_input,
    sample_training_input,
    single_split,
)

NEITHER = "neither"
_NOT_IN_RECIPE = ("num_experts", "expert_noise", "expert_noise_seed", "activity_epsilon", "failure_margin")


class SkillsTaskSettings(SkillsTaskSpec):
    """`task:` of a compare config for the sequential-skills family; see
    `mergecompose.studies.skills.SkillsTaskSpec`."""

    model_config = ConfigDict(allow_inf_nan=False)  # merged with the spec's: every float is finite

    type: Literal["skills"] = "skills"
    formulation: Literal["seq2seq"] = "seq2seq"
    # The imperfect-expert variant: Gaussian noise of `expert_noise` × the RMS of each tensor of
    # the task vector is added to every full expert (`noisy_expert`), so that it deviates from the
    # base outside its skill too. 0 leaves the experts as trained.
    expert_noise: float = Field(0.0, ge=0)
    expert_noise_seed: int = Field(0, ge=0)
    # Analysis: the activity threshold ε (nats of KL(p_i ‖ p_b)), and how many tokens past the
    # target greedy decoding may run (to tell a late EOS from a missing one).
    activity_epsilon: float = Field(0.1, ge=0)
    failure_margin: int = Field(8, ge=1)

    def title(self) -> str:
        return "sequential skills"

    def check_config(self, config) -> None:
        """Evaluation lengths must hold one segment per expert; length-changing skills need contiguous positions."""
        self.check_lengths(config.eval_length, config.evaluation.lengths)
        changing = self.length_changing()
        if changing and config.positions.scheme == "coupled":
            raise ValueError(
                f"skills {changing} change the length of their segment; `positions.scheme: coupled` gives y_k the "
                "position of x_k and needs length-preserving transforms (reverse, shift, mirror, swap_pairs, rotate); "
                "use `positions: {scheme: contiguous}` for these"
            )

    def length_changing(self) -> list[str]:
        """The composed skills whose transform changes a segment's length (e.g. `double`)."""
        return [s.name for s in self.experts if not get_transform(s.transform).preserves_length]

    def generation_margin(self) -> int:
        """Tokens greedy decoding may generate past a target: the failure analysis runs `failure_margin` past it."""
        return max(2, self.failure_margin)

    def max_target_length(self, length: int) -> int:
        """The longest target (joint or one expert's) of an input of `length` characters."""
        return length * max(get_transform(s.transform).growth for s in self.experts)

    @property
    def joint(self) -> list[str]:
        return [skill.name for skill in self.experts]

    def trained_skills(self) -> list[str]:
        return self.joint

    def skill_names(self) -> list[str]:
        """Every skill of the list, also those beyond `num_experts` (configs for several k share settings)."""
        return [skill.name for skill in self.skills]

    def data_recipe(self) -> dict:
        """Everything that shapes the training data; not `num_experts` (checkpoints are shared across k) nor the
        analysis."""
        return self.model_dump(mode="json", exclude=set(_NOT_IN_RECIPE))

    def skill_recipe(self, name: str) -> dict:
        return {"skill_spec": self.skill(name).model_dump(mode="json")}

    def training_strings(self, skill: str | None, tokenizer, sequence_format, settings, seed: int) -> TrainingStrings:
        """Training batches for the base (`skill=None`, copy) or expert `skill`."""
        if skill is not None:
            self.skill(skill)  # raises on an unknown name
        applied = [] if skill is None else [skill]
        return TrainingStrings(
            lambda rng: sample_training_input(rng, self, own=skill),
            lambda text: rewrite(text, self, applied).text,
            tokenizer,
            sequence_format,
            settings,
            seed,
        )

    def eval_data(self, settings, main_length: int, train_max: int):
        return build_skills_eval_data(self, settings, main_length, train_max)

    def expert_variant(self, base, expert, name: str):
        """The expert the systems use: as trained, or with noise on its task vector (`expert_noise`)."""
        if self.expert_noise == 0:
            return expert
        index = [skill.name for skill in self.skills].index(name)
        return noisy_expert(base, expert, self.expert_noise, seed=self.expert_noise_seed * 1000 + index)

    def sections(self) -> dict:
        """Results sections `mergecompose compare` adds for this task."""
        return {"skills_failures": failure_section}

    def plots(self, results: dict, out_dir) -> list[str]:
        """`activity.png`: the plain composition's per-position expert activity on a few joint inputs."""
        noise = results.get("skills_failures", {}).get("noise", {}).get(JOINT)
        if not noise or not noise.get("heatmap"):
            return []
        # The composed experts are the first k skills, in order: label the rows with the skills' names.
        names = self.joint if len(self.joint) == len(noise["experts"]) else noise["experts"]
        plot_activity_heatmap(
            noise["heatmap"],
            names,
            Path(out_dir) / "activity.png",
            intervals_label="the expert's own segment, markers included",
        )
        return ["activity.png"]

    def check_lengths(self, main_length: int, lengths: Sequence[int]) -> None:
        """Every joint split and curve must hold one segment per expert."""
        shortest = self.num_experts * (self.segment_lengths[0] + 2)
        short = [length for length in [main_length, *lengths] if length < shortest]
        if short:
            raise ValueError(
                f"evaluation lengths {sorted(set(short))} cannot hold one segment of each of the {self.num_experts} "
                f"experts (need at least {shortest} characters); raise `evaluation.length` / `evaluation.lengths`"
            )


# ---------------------------------------------------------------------------------------------
# Inputs


def training_like_input(rng: random.Random, spec: SkillsTaskSpec, own: str | None, length: int | None = None) -> str:
    """An input as training draws them (each skill's pair with `marker_rate`, `own`'s always when given).

    With `length`, exactly that many characters; otherwise a length from `train_lengths`.
    """
    present = [s.name for s in spec.skills if s.name == own or rng.random() < spec.marker_rate]
    limit = max_segments(spec, length if length is not None else spec.train_lengths[1])
    while len(present) > limit:
        present.remove(rng.choice([name for name in present if name != own]))
    if length is None:
        shortest = len(present) * (spec.segment_lengths[0] + 2)
        length = rng.randint(max(spec.train_lengths[0], shortest), spec.train_lengths[1])
    return sample_input(rng, spec, present, length)


def split_input_at(rng: random.Random, spec: SkillsTaskSpec, split: str, length: int) -> str:
    """An input of a main split (`joint`, `only_<skill>`, `neither`) at exactly `length` characters."""
    if split == JOINT:
        return sample_input(rng, spec, [s.name for s in spec.experts], length)
    if split == NEITHER:
        return sample_input(rng, spec, [], length)
    if split.startswith("only_"):
        return sample_input(rng, spec, [spec.skill(split[len("only_") :]).name], length)
    raise ValueError(f"unknown main split {split!r}; valid: 'joint', 'only_<skill>', 'neither'")


def distinct_held_out(
    draw: Callable[[], str], count: int, exclude: set[str], what: str, max_draws: int = 1_000_000
) -> list[str]:
    """`count` distinct strings from `draw` that are held out (`experiments.training_strings.is_held_out`) and
    not in `exclude`."""
    return distinct_strings(lambda: [draw()], count, is_held_out, exclude, what, max_draws)


# ---------------------------------------------------------------------------------------------
# Evaluation data


def build_skills_eval_data(spec: SkillsTaskSettings, settings, main_length: int, train_max: int):
    """Every evaluation set, from held-out strings only, seeded by `settings.seed` (see the module doc).

    Test: `joint` (`joint_size`), each `only_<skill>` and `neither` (`split_size`), all of exactly
    `main_length` characters, and `length_L` (`length_size`) for each L in `settings.lengths`
    beyond `train_max`. Validation: the main splits again (`validation_size` each), disjoint
    from the test strings. Curves: `copy`, `skill:<name>` and `joint` at every L in `settings.lengths`.
    """
    spec.check_lengths(main_length, settings.lengths)
    rng = random.Random(settings.seed)
    used: set[str] = set()

    def draw(name: str, make: Callable[[], str], count: int, applied: Sequence[str] | None, length: int):
        sources = distinct_held_out(make, count, used, name)
        used.update(sources)
        if applied is None:
            targets = [joint_target(text, spec).text for text in sources]
        else:
            targets = [rewrite(text, spec, applied).text for text in sources]
        return EvalSet(name, length, tuple(sources), tuple(targets))

    def split_set(name: str, split: str, length: int, count: int):
        return draw(name, lambda: split_input_at(rng, spec, split, length), count, None, length)

    main = [JOINT, *(single_split(name) for name in spec.joint), NEITHER]
    test = {JOINT: split_set(JOINT, JOINT, main_length, settings.joint_size)}
    for split in main[1:]:
        test[split] = split_set(split, split, main_length, settings.split_size)
    for length in settings.lengths:
        if length > train_max:
            test[length_split(length)] = split_set(length_split(length), JOINT, length, settings.length_size)
    validation = {split: split_set(split, split, main_length, settings.validation_size) for split in main}

    curves: dict[str, dict] = {"copy": {}, JOINT: {}, **{f"skill:{name}": {} for name in spec.joint}}
    for length in settings.lengths:
        curves["copy"][length] = draw(
            f"copy@{length}",
            lambda length=length: training_like_input(rng, spec, None, length),
            settings.length_size,
            [],
            length,
        )
        for name in spec.joint:
            curves[f"skill:{name}"][length] = draw(
                f"skill:{name}@{length}",
                lambda name=name, length=length: training_like_input(rng, spec, name, length),
                settings.length_size,
                [name],
                length,
            )
        if length == main_length:
            curves[JOINT][length] = test[JOINT]
        elif length_split(length) in test:
            curves[JOINT][length] = test[length_split(length)]
        else:
            curves[JOINT][length] = split_set(f"joint@{length}", JOINT, length, settings.length_size)
    return EvalData(test, validation, curves)


# ---------------------------------------------------------------------------------------------
# Imperfect experts


def noisy_expert(base: torch.nn.Module, expert: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """`θ_b + τ + ε`, with `τ = θ_expert − θ_b` and `ε[name] ~ N(0, (scale · rms(τ[name]))²)` per tensor.

    The noise is proportional to how far fine-tuning moved each tensor, so it models an expert
    whose update is imprecise everywhere: it now deviates from the base outside its skill too.
    Returns a new model; neither input is modified.
    """
    if not scale >= 0:
        raise ValueError(f"`scale` must be >= 0, got {scale}")
    task_vector = TaskVector.from_models(base, expert)
    generator = torch.Generator().manual_seed(seed)
    noise = {}
    for name, tensor in sorted(task_vector.tensors.items()):
        rms = tensor.float().pow(2).mean().sqrt()
        noise[name] = scale * rms * torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
    return (task_vector + TaskVector(noise)).apply_to(base).eval()
