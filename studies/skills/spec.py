"""Sequential skills: experts that act only between two stopping times, composed k at a time.

An input mixes plain text with marked segments, one marker pair per skill, e.g.
`AB[CDE]F<GH>I`. The base copies everything. Expert i copies too, but rewrites the inside of
its own marker pair (reverse it, shift each letter, ...). A segment's position and length vary
from input to input, so expert i's active interval `[τ1, τ2)` (Kumar, Bucarelli & Natale,
2026: "factorizable skills") is a data-dependent stopping time, not a fixed position. The
intervals of different experts are disjoint by construction (segments never nest or overlap),
so the composed target applies every skill in its own segment and copies the rest.

Everything here is data: the skills, their markers and transforms are read from YAML
(`SkillsTaskSpec`), and `num_experts` picks the first k skills of the list. Nothing here
tokenizes or trains; `mergecompose.studies.skills.skills_task_type` (splits, training data) and the trainer build on
these functions.

Region labels mark what each target character is, so that a wrong output can be placed:
`BACKGROUND` (plain text), `SEGMENT` (inside a marker pair), `BOUNDARY` (a marker character,
where a skill starts or stops) and `END` (the EOS position, one past the last character).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mergecompose.analysis.failures import (  # noqa: F401 (re-exported)
    BACKGROUND,
    BOUNDARY,
    END,
    NO_OWNER,
    REGION_NAMES,
    SEGMENT,
)

# ---------------------------------------------------------------------------------------------
# Transforms: one registry, a duplicate name is an error, an unknown name lists the valid ones.


@dataclass(frozen=True)
class Transform:
    """A rewrite of a segment's letters. `apply(content, alphabet, amount) -> str`."""

    name: str
    apply: Callable[[str, str, int], str]
    preserves_length: bool
    description: str
    growth: int = 1  # the most the transform multiplies a segment's length by


TRANSFORMS: dict[str, Transform] = {}


def register_transform(name: str, preserves_length: bool, description: str, growth: int = 1):
    def decorator(function: Callable[[str, str, int], str]):
        if name in TRANSFORMS:
            raise ValueError(f"transform {name!r} is already registered")
        if growth < 1:
            raise ValueError(f"`growth` must be >= 1, got {growth}")
        TRANSFORMS[name] = Transform(name, function, preserves_length, description, growth)
        return function

    return decorator


def get_transform(name: str) -> Transform:
    if name not in TRANSFORMS:
        raise ValueError(f"unknown transform {name!r}; valid: {sorted(TRANSFORMS)}")
    return TRANSFORMS[name]


def _shift_letter(character: str, alphabet: str, amount: int) -> str:
    index = alphabet.find(character)
    return character if index < 0 else alphabet[(index + amount) % len(alphabet)]


@register_transform("reverse", True, "reverse the segment: ABC -> CBA")
def _reverse(content: str, alphabet: str, amount: int) -> str:
    return content[::-1]


@register_transform("shift", True, "shift each letter by `amount` in the alphabet, cyclically: A -> B for amount 1")
def _shift(content: str, alphabet: str, amount: int) -> str:
    return "".join(_shift_letter(c, alphabet, amount) for c in content)


@register_transform("mirror", True, "map the i-th letter of the alphabet to the i-th from the end: A -> Z")
def _mirror(content: str, alphabet: str, amount: int) -> str:
    return "".join(alphabet[len(alphabet) - 1 - alphabet.index(c)] if c in alphabet else c for c in content)


@register_transform("swap_pairs", True, "swap neighbours pairwise: ABCDE -> BADCE")
def _swap_pairs(content: str, alphabet: str, amount: int) -> str:
    characters = list(content)
    for index in range(0, len(characters) - 1, 2):
        characters[index], characters[index + 1] = characters[index + 1], characters[index]
    return "".join(characters)


@register_transform("rotate", True, "rotate left by `amount`: ABCD -> BCDA for amount 1")
def _rotate(content: str, alphabet: str, amount: int) -> str:
    if not content:
        return content
    amount %= len(content)
    return content[amount:] + content[:amount]


@register_transform("double", False, "write each letter twice: ABC -> AABBCC (changes the length)", growth=2)
def _double(content: str, alphabet: str, amount: int) -> str:
    return "".join(c + c for c in content)


# ---------------------------------------------------------------------------------------------
# The task as data


class SkillSpec(BaseModel):
    """One skill: the marker pair that delimits its segments and what the expert does inside."""

    model_config = ConfigDict(extra="forbid")

    name: str
    open: str
    close: str
    transform: str
    amount: int = 1

    @field_validator("open", "close")
    @classmethod
    def _one_character(cls, value: str, info) -> str:
        if len(value) != 1:
            raise ValueError(f"`{info.field_name}` must be one character, got {value!r}")
        return value

    @field_validator("transform")
    @classmethod
    def _known_transform(cls, value: str) -> str:
        get_transform(value)
        return value

    @model_validator(mode="after")
    def _distinct_markers(self):
        if self.open == self.close:
            raise ValueError(f"skill {self.name!r}: `open` and `close` must differ, got {self.open!r} for both")
        return self

    def rewrite(self, content: str, alphabet: str) -> str:
        return get_transform(self.transform).apply(content, alphabet, self.amount)


class SkillsTaskSpec(BaseModel):
    """The sequential-skills family. `num_experts` (k) picks the first k entries of `skills`.

    Training inputs are `train_lengths` = (min, max) characters long, markers included. Each
    segment holds `segment_lengths` = (min, max) letters from `letters`; the background draws
    from `letters` plus `background_extra` (e.g. a space). In a training input each skill's
    marker pair appears with probability `marker_rate`, an expert's own pair with
    `own_marker_rate`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    letters: str = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    background_extra: str = " "
    skills: list[SkillSpec]
    num_experts: int = Field(ge=1)
    train_lengths: tuple[int, int] = (1, 32)
    segment_lengths: tuple[int, int] = (2, 5)
    marker_rate: float = Field(0.5, ge=0, le=1)
    own_marker_rate: float = Field(0.8, ge=0, le=1)

    @field_validator("train_lengths", "segment_lengths")
    @classmethod
    def _range(cls, value, info):
        low, high = value
        if not 1 <= low <= high:
            raise ValueError(f"`{info.field_name}` must be (min, max) with 1 <= min <= max, got {value}")
        return value

    @model_validator(mode="after")
    def _consistent(self):
        if len(set(self.letters)) != len(self.letters) or not self.letters:
            raise ValueError(f"`letters` must be non-empty with distinct characters, got {self.letters!r}")
        names = [skill.name for skill in self.skills]
        if len(set(names)) != len(names):
            raise ValueError(f"skill names must be distinct, got {names}")
        if self.num_experts > len(self.skills):
            raise ValueError(
                f"`num_experts` must be at most the number of skills ({len(self.skills)}), got {self.num_experts}"
            )
        markers = [m for skill in self.skills for m in (skill.open, skill.close)]
        if len(set(markers)) != len(markers):
            raise ValueError(f"marker characters must be distinct across skills, got {markers}")
        clash = sorted(set(markers) & set(self.letters + self.background_extra))
        if clash:
            raise ValueError(f"marker characters {clash} also appear in `letters` or `background_extra`")
        needed = self.num_experts * (self.segment_lengths[0] + 2)
        if needed > self.train_lengths[1]:
            raise ValueError(
                f"`train_lengths` max ({self.train_lengths[1]}) cannot hold one segment per expert: {self.num_experts} "
                f"segments of at least {self.segment_lengths[0]} letters plus 2 markers need {needed}"
            )
        return self

    @property
    def experts(self) -> list[SkillSpec]:
        """The k composed skills."""
        return self.skills[: self.num_experts]

    @property
    def alphabet(self) -> str:
        """Every character an input or target can hold, in a fixed order (the tokenizer's alphabet)."""
        markers = "".join(skill.open + skill.close for skill in self.skills)
        return "".join(dict.fromkeys(self.letters + self.background_extra + markers))

    def skill(self, name: str) -> SkillSpec:
        for skill in self.skills:
            if skill.name == name:
                return skill
        raise ValueError(f"unknown skill {name!r}; valid: {[s.name for s in self.skills]}")


# ---------------------------------------------------------------------------------------------
# Parsing and targets


@dataclass(frozen=True)
class Segment:
    """A marked segment of an input: `text[start]` is the open marker, `text[end - 1]` the close one."""

    skill: str
    start: int
    end: int


def find_segments(text: str, skills: Sequence[SkillSpec]) -> list[Segment]:
    """The marked segments of `text`, left to right.

    Raises ValueError on a close marker with no open one, an open marker inside another segment
    (segments never nest) or a segment left open.
    """
    opens = {skill.open: skill for skill in skills}
    closes = {skill.close: skill for skill in skills}
    segments, current, start = [], None, 0
    for index, character in enumerate(text):
        if character in opens:
            if current is not None:
                raise ValueError(
                    f"`text` has marker {character!r} at {index} inside the {current.name!r} segment "
                    f"opened at {start}: "
                    "segments may not nest"
                )
            current, start = opens[character], index
        elif character in closes:
            if current is None or closes[character] is not current:
                raise ValueError(f"`text` has close marker {character!r} at {index} with no matching open marker")
            segments.append(Segment(current.name, start, index + 1))
            current = None
    if current is not None:
        raise ValueError(f"`text` leaves the {current.name!r} segment opened at {start} unclosed")
    return segments


@dataclass(frozen=True)
class Target:
    """A target string with a region label and an owner per character.

    `regions[j]` is BACKGROUND, SEGMENT or BOUNDARY for `text[j]`; `owners[j]` is the index (in
    the task's `skills`) of the segment that holds `text[j]`, its markers included, or NO_OWNER.
    The EOS position `len(text)` has region END (see `region_labels`).
    """

    text: str
    regions: tuple[int, ...]
    owners: tuple[int, ...]


def rewrite(text: str, spec: SkillsTaskSpec, apply: Sequence[str]) -> Target:
    """The target of `text` when the skills named in `apply` act and everything else is copied.

    `apply=()` is the base's target (copy), `apply=[name]` expert `name`'s, and every expert's
    name together the joint (composed) target. Markers are always copied.
    """
    unknown = [name for name in apply if name not in {s.name for s in spec.skills}]
    if unknown:
        raise ValueError(f"`apply` names unknown skills {unknown}; valid: {[s.name for s in spec.skills]}")
    index_of = {skill.name: index for index, skill in enumerate(spec.skills)}
    pieces, regions, owners = [], [], []

    def emit(piece: str, region: int, owner: int) -> None:
        pieces.append(piece)
        regions.extend([region] * len(piece))
        owners.extend([owner] * len(piece))

    cursor = 0
    for segment in find_segments(text, spec.skills):
        skill = spec.skill(segment.skill)
        owner = index_of[skill.name]
        emit(text[cursor : segment.start], BACKGROUND, NO_OWNER)
        content = text[segment.start + 1 : segment.end - 1]
        emit(skill.open, BOUNDARY, owner)
        emit(skill.rewrite(content, spec.letters) if skill.name in apply else content, SEGMENT, owner)
        emit(skill.close, BOUNDARY, owner)
        cursor = segment.end
    emit(text[cursor:], BACKGROUND, NO_OWNER)
    return Target("".join(pieces), tuple(regions), tuple(owners))


def region_labels(target: Target) -> list[int]:
    """Region per output step: one per target character, then END for the EOS step."""
    return [*target.regions, END]


# ---------------------------------------------------------------------------------------------
# Sampling inputs


def sample_input(rng: random.Random, spec: SkillsTaskSpec, present: Sequence[str], length: int) -> str:
    """A random input of exactly `length` characters with one segment per skill in `present`.

    The segments appear in a random order; each holds `segment_lengths` (min … max) random letters
    (shortened, longest first, when they would not fit), and the rest of the length is
    background split at random between the gaps before, between and after them (a gap may be
    empty, so two segments can touch).
    """
    skills = [spec.skill(name) for name in present]
    shortest = len(skills) * (spec.segment_lengths[0] + 2)
    if length < shortest:
        raise ValueError(
            f"`length` {length} cannot hold {len(skills)} segments of at least {spec.segment_lengths[0]} letters; "
            f"need at least {shortest}"
        )
    rng.shuffle(skills)
    sizes = [rng.randint(spec.segment_lengths[0], spec.segment_lengths[1]) for _ in skills]
    while sum(sizes) + 2 * len(sizes) > length:
        sizes[sizes.index(max(sizes))] -= 1
    background = length - sum(sizes) - 2 * len(sizes)
    # Split the background into len(skills) + 1 gaps: cut points drawn with replacement.
    cuts = sorted(rng.randint(0, background) for _ in skills)
    gaps = [b - a for a, b in zip([0, *cuts], [*cuts, background])]
    plain = spec.letters + spec.background_extra
    pieces = []
    for gap, skill, size in zip(gaps, skills, sizes):
        pieces.append("".join(rng.choice(plain) for _ in range(gap)))
        pieces.append(skill.open + "".join(rng.choice(spec.letters) for _ in range(size)) + skill.close)
    pieces.append("".join(rng.choice(plain) for _ in range(gaps[-1])))
    return "".join(pieces)


def max_segments(spec: SkillsTaskSpec, length: int) -> int:
    """How many segments of minimal size fit in `length` characters."""
    return length // (spec.segment_lengths[0] + 2)


def sample_training_input(rng: random.Random, spec: SkillsTaskSpec, own: str | None = None) -> str:
    """A training input: each skill's pair present with `marker_rate` (`own` with `own_marker_rate`).

    Every skill of the list, not only the k composed ones, can appear, so that the base and
    each expert are the same models whatever k is; the length is drawn from `train_lengths`, at least
    enough for the drawn segments (extra segments are dropped, `own` last, when even
    the longest training length is too short).
    """
    present = []
    for skill in spec.skills:
        rate = spec.own_marker_rate if skill.name == own else spec.marker_rate
        if rng.random() < rate:
            present.append(skill.name)
    fit = max_segments(spec, spec.train_lengths[1])
    while len(present) > fit:
        droppable = [name for name in present if name != own]
        present.remove(rng.choice(droppable))
    shortest = len(present) * (spec.segment_lengths[0] + 2)
    length = rng.randint(max(spec.train_lengths[0], shortest), spec.train_lengths[1])
    return sample_input(rng, spec, present, length)


# ---------------------------------------------------------------------------------------------
# Evaluation splits


def single_split(name: str) -> str:
    """The split in which only skill `name`'s marker pair appears."""
    return f"only_{name}"


def length_split(length: int) -> str:
    """The joint split at exactly `length` input characters."""
    return f"length_{length}"


def split_names(spec: SkillsTaskSpec, lengths: Sequence[int] = ()) -> list[str]:
    """`joint`, one `only_<skill>` per composed expert, `neither`, then one `length_<L>` per length."""
    return ["joint", *(single_split(s.name) for s in spec.experts), "neither", *(length_split(n) for n in lengths)]


def joint_target(text: str, spec: SkillsTaskSpec) -> Target:
    """What the composition should output: every composed expert's skill applied in its segments."""
    return rewrite(text, spec, [s.name for s in spec.experts])
