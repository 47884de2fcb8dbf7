"""Letter replacement (Kumar, Bucarelli & Natale, 2026): rules as data, sampling and splits.

The base copies a string. An expert copies with some letters replaced, e.g. `ab` = {A → B}.
The joint task applies several experts' replacements at once: with `ab` and `cd`,
`"CAB"` → `"DBB"`. Replacements are applied per character and simultaneously (never chained).

A skill is *active* on a string when one of its source letters occurs in it. The evaluation
splits partition strings by which of the joint skills are active:

    joint     every joint skill active (both A and C present, for ab + cd)
    <skill>   only that joint skill active (A present, no C: split `ab`)
    neither   no joint skill active

Every split is scored against the joint target, so the base is right only on `neither`, an
expert only on its own split and `neither`, and a working combination everywhere.
Nothing here tokenizes or trains: these are functions of strings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from mergecompose.experiments.evaluate import JOINT
from mergecompose.experiments.training_strings import distinct_strings

NEITHER = "neither"


@dataclass(frozen=True)
class Skill:
    """One expert's rule: `replace` maps a source letter to the letter written in its place."""

    name: str
    replace: Mapping[str, str]

    @property
    def sources(self) -> frozenset[str]:
        return frozenset(self.replace)

    def apply(self, text: str) -> str:
        return apply_replacements(text, self.replace)

    def is_active(self, text: str) -> bool:
        return not self.sources.isdisjoint(text)


def apply_replacements(text: str, replace: Mapping[str, str]) -> str:
    """Replace every character c of `text` by `replace.get(c, c)`, all at once (no chaining)."""
    return "".join(replace.get(character, character) for character in text)


def combined_replacements(skills: Sequence[Skill]) -> dict[str, str]:
    """The union of several skills' maps; a letter that two skills send to different letters is an error."""
    combined: dict[str, str] = {}
    owner: dict[str, str] = {}
    for skill in skills:
        for source, target in skill.replace.items():
            if source in combined and combined[source] != target:
                raise ValueError(
                    f"skills `{owner[source]}` and `{skill.name}` both rewrite {source!r} "
                    f"({source!r} → {combined[source]!r} and {source!r} → {target!r}); "
                    "their joint target is undefined"
                )
            combined[source] = target
            owner[source] = skill.name
    return combined


class LetterTask:
    """The skills, the alphabet, and which skills make the joint task.

    Args:
        alphabet: the characters strings are drawn from.
        skills: name -> replacement map, e.g. `{"ab": {"A": "B"}, "cd": {"C": "D"}}`.
        joint: the names of the skills applied together (compose and merges); their maps must
            not conflict. Other skills (such as a conflicting `ac`) are trained and evaluated on
            their own skill only.
    """

    def __init__(self, alphabet: str, skills: Mapping[str, Mapping[str, str]], joint: Sequence[str]):
        if len(alphabet) == 0 or len(set(alphabet)) != len(alphabet):
            raise ValueError(f"`alphabet` must be a non-empty string of distinct characters, got {alphabet!r}")
        self.alphabet = alphabet
        self.skills: dict[str, Skill] = {}
        for name, replace in skills.items():
            for source, target in replace.items():
                for letter in (source, target):
                    if len(letter) != 1 or letter not in alphabet:
                        raise ValueError(
                            f"skill `{name}` maps {source!r} → {target!r}; both must be single characters "
                            f"of the alphabet {alphabet!r}"
                        )
            if len(replace) == 0 or all(source == target for source, target in replace.items()):
                raise ValueError(
                    f"skill `{name}` replaces nothing ({dict(replace)!r}); give at least one A → B with A ≠ B"
                )
            self.skills[name] = Skill(name, dict(replace))
        unknown = [name for name in joint if name not in self.skills]
        if unknown or len(joint) < 2 or len(set(joint)) != len(joint):
            raise ValueError(
                f"`joint` must name two or more distinct skills among {sorted(self.skills)}, got {list(joint)}"
            )
        self.joint = tuple(joint)
        self.joint_replace = combined_replacements([self.skills[name] for name in joint])
        self.split_names = (JOINT, *self.joint, NEITHER)

    def target(self, text: str, skills: Iterable[str] | None = None) -> str:
        """`text` with the replacements of `skills` (default: the joint skills) applied."""
        if skills is None:
            return apply_replacements(text, self.joint_replace)
        return apply_replacements(text, combined_replacements([self.skills[name] for name in skills]))

    def split_of(self, text: str) -> str:
        """Which split `text` belongs to: `joint`, a joint skill's name, or `neither`."""
        active = [name for name in self.joint if self.skills[name].is_active(text)]
        if len(active) == len(self.joint):
            return JOINT
        if len(active) == 1:
            return active[0]
        if not active:
            return NEITHER
        return "several"  # some but not all of three or more joint skills; in no named split

    def membership(self, split: str) -> Callable[[str], bool]:
        """A predicate for the strings of a named split, or of an expert's own skill (`skill:<name>`)."""
        if split.startswith("skill:"):
            skill = self.skills.get(split.removeprefix("skill:"))
            if skill is None:
                raise ValueError(f"unknown skill in {split!r}; skills: {sorted(self.skills)}")
            return skill.is_active
        if split == "copy":
            return lambda text: True
        if split not in self.split_names:
            raise ValueError(f"unknown split {split!r}; valid: {list(self.split_names)}, 'copy' or 'skill:<name>'")
        return lambda text: self.split_of(text) == split


def sample_strings(
    alphabet: str,
    length: int,
    count: int,
    rng: np.random.Generator,
    keep: Callable[[str], bool] = lambda text: True,
    exclude: set[str] | frozenset[str] = frozenset(),
    max_draws: int = 2_000_000,
) -> list[str]:
    """`count` distinct uniformly random strings of `length` characters that satisfy `keep`.

    Rejection sampling: each draw is uniform over alphabet^length, so the result is uniform over
    the accepted set minus `exclude`. Raises a ValueError when fewer than `count` distinct
    strings turn up in `max_draws` draws (e.g. `joint` at length 1 has no members).
    """
    if length < 1:
        raise ValueError(f"`length` must be >= 1, got {length}")
    letters = np.array(list(alphabet))
    chunk = max(64, 4 * count)

    def draw() -> list[str]:
        return ["".join(row) for row in letters[rng.integers(0, len(alphabet), size=(chunk, length))]]

    what = f"length {length} that pass the split's condition (the split is nearly empty at this length)"
    return distinct_strings(draw, count, keep, exclude, what, max_draws)
