"""The letter-replacement task type (`task: {type: letters}`, the default): its settings, training strings and
evaluation data."""

from __future__ import annotations

import random
import zlib
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mergecompose.experiments.evaluate import EvalData, EvalSet
from mergecompose.experiments.training_strings import TrainingStrings, is_held_out
from mergecompose.studies.letters.task import JOINT, LetterTask, apply_replacements, sample_strings


class LettersTaskSettings(BaseModel):
    """The letter-replacement task: skills as data (name -> {source: replacement}); see
    `mergecompose.experiments.plugins.TaskType`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["letters"] = Field("letters", exclude=True)  # left out of dumps: hashes stay as they were
    formulation: Literal["seq2seq", "aligned"] = "seq2seq"
    alphabet: str = "ABCDEFGHIJKLMNOPQRSTUVWXYZ "
    skills: dict[str, dict[str, str]] = Field(
        default_factory=lambda: {"ab": {"A": "B"}, "cd": {"C": "D"}, "ac": {"A": "C"}}
    )
    joint: list[str] = Field(default_factory=lambda: ["ab", "cd"])
    train_lengths: tuple[int, int] = (1, 16)

    @field_validator("train_lengths")
    @classmethod
    def _lengths(cls, value):
        low, high = value
        if not 1 <= low <= high:
            raise ValueError(f"`train_lengths` must be (min, max) with 1 <= min <= max, got {value}")
        return value

    @model_validator(mode="after")
    def _task(self):
        self.letter_task()  # raises ValueError naming the bad skill, letter or joint entry
        return self

    def letter_task(self) -> LetterTask:
        return LetterTask(self.alphabet, self.skills, self.joint)

    # ---- what the compare pipeline asks of a task type

    def lm_eval_choices(self, source: str) -> tuple[list[str], int]:
        """The multiple choices of a `type: lm_eval` compare's choice task (`native_run.choice_split`): the joint
        target, the copy and the first joint expert's output, in an order fixed by the source; the target's index."""
        task = self.letter_task()
        options = [task.target(source), source, task.target(source, [self.joint[0]])]
        shift = zlib.crc32(source.encode()) % len(options)
        return options[shift:] + options[:shift], (len(options) - shift) % len(options)

    def trained_skills(self) -> list[str]:
        return list(self.skills)

    def title(self) -> str:
        return "letter replacement"

    def check_config(self, config) -> None:
        """Nothing beyond what the compare config checks itself."""

    def skill_names(self) -> list[str]:
        """Every skill the task defines (trained or not)."""
        return list(self.skills)

    def plots(self, results: dict, out_dir) -> list[str]:
        """Task-specific plots beside `length.png`; the letters task has none."""
        return []

    def max_target_length(self, length: int) -> int:
        """The longest target of an input of `length` characters: letter replacement keeps lengths."""
        return length

    def generation_margin(self) -> int:
        """Tokens greedy decoding may generate past a target: two, for the greedy check."""
        return 2

    def data_recipe(self) -> dict | None:
        return None  # the alphabet and lengths, already in every checkpoint's recipe, fix the data

    def skill_recipe(self, name: str) -> dict:
        return {"replace": self.skills[name]}

    def training_strings(self, skill: str | None, tokenizer, sequence_format, settings, seed: int) -> TrainingStrings:
        """Uniformly random strings (lengths uniform in `train_lengths`) and their replaced targets."""
        replace = {} if skill is None else self.skills[skill]
        return letter_training_strings(
            self.alphabet, self.train_lengths, replace, tokenizer, sequence_format, settings, seed
        )

    def eval_data(self, settings, main_length: int, train_max: int) -> EvalData:
        return build_eval_data(self.letter_task(), settings, main_length, train_max)

    def expert_variant(self, base, expert, name: str):
        return expert

    def sections(self) -> dict:
        return {}


def letter_training_strings(
    alphabet: str, lengths: tuple[int, int], replace: dict[str, str], tokenizer, sequence_format, settings, seed: int
) -> TrainingStrings:
    """Uniformly random strings (length uniform in `lengths`, letters uniform), targets with `replace` applied."""

    def sample(rng: random.Random) -> str:
        length = rng.randint(*lengths)
        return "".join(rng.choices(alphabet, k=length))

    return TrainingStrings(
        sample, lambda text: apply_replacements(text, replace), tokenizer, sequence_format, settings, seed
    )


def build_eval_data(task: LetterTask, settings, main_length: int, train_max: int) -> EvalData:
    """Sample every evaluation set from held-out strings only (`is_held_out`), seeded by `settings.seed`.

    Test splits: `joint` (`joint_size` strings), one per joint skill and `neither` (`split_size`
    each), all of length `main_length`, and `length_L` (joint inputs, `length_size` strings) for
    each L in `settings.lengths` beyond `train_max`. Validation: the main splits again
    (`validation_size` each), disjoint from the test strings.
    """
    rng = np.random.default_rng(settings.seed)
    used: set[str] = set()

    def draw(name: str, split: str, length: int, count: int, skills=None) -> EvalSet:
        member = task.membership(split)
        sources = sample_strings(
            task.alphabet, length, count, rng, keep=lambda text: is_held_out(text) and member(text), exclude=used
        )
        used.update(sources)
        targets = [task.target(text, skills) for text in sources]
        return EvalSet(name, length, tuple(sources), tuple(targets))

    test = {JOINT: draw(JOINT, JOINT, main_length, settings.joint_size)}
    for split in task.split_names[1:]:
        test[split] = draw(split, split, main_length, settings.split_size)
    for length in settings.lengths:
        if length > train_max:
            test[f"length_{length}"] = draw(f"length_{length}", JOINT, length, settings.length_size)
    validation = {split: draw(split, split, main_length, settings.validation_size) for split in task.split_names}

    curves: dict[str, dict[int, EvalSet]] = {"copy": {}, JOINT: {}}
    for name in task.skills:
        curves[f"skill:{name}"] = {}
    for length in settings.lengths:
        curves["copy"][length] = draw(f"copy@{length}", "copy", length, settings.length_size, skills=[])
        for name in task.skills:
            kind = f"skill:{name}"
            curves[kind][length] = draw(f"{kind}@{length}", kind, length, settings.length_size, skills=[name])
        if length == main_length:
            curves[JOINT][length] = test[JOINT]
        elif f"length_{length}" in test:
            curves[JOINT][length] = test[f"length_{length}"]
        else:
            curves[JOINT][length] = draw(f"joint@{length}", JOINT, length, settings.length_size)
    return EvalData(test, validation, curves)
