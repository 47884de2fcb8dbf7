"""The skills of the real settings: prompts, reference answers and what their scorers need, by split.

Two kinds of skill, each one expert:

* a **content** skill decides what the answer says: `units` (metric conversions by 10, 100 or 1000),
  `dates` (an ISO date written in words), `sort` (four numbers, smallest first);
* a **format** skill decides how the answer is written, whatever it says: `json` (`{"answer": "…"}`),
  `brackets` (the answer in square brackets), `signature` (a closing line `— SmolLM`). Its expert is
  trained on easy questions the base already answers (`_easy_item`), so that it learns the format alone;
* a **style** skill rewrites the whole answer: `capitals`, `opening`, `one_sentence` (`style_data`, which says
  how its expert learns it from the base's own answers); `signature` pairs with them as a style.

A **joint** item needs two skills (`joint_items`): *simultaneous*, a content skill's question asked in a
format or style skill's form; *sequential*, two content questions answered one after the other, one per line;
or *two styles*, a general question asked with both styles' instructions.

Every skill has its own phrasings (templates) per split: the train split's are disjoint from those of
the validation and test splits, which share theirs and are told apart by their items (`skill_items` draws
each split from its own seed and drops an item the other held-out split already holds). Answers are at
most 32 tokens. Nothing here loads a model.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from mergecompose.studies.math_code.splits import check_count, check_split
from mergecompose.studies.skill_pairs.style_data import (
    STYLE_PHRASINGS,
    STYLE_SKILLS,
    WHOLE_ANSWER_STYLES,
    restyled,
    style_question,
)

CONTENT_SKILLS = ("units", "dates", "sort")
FORMAT_SKILLS = ("json", "brackets", "signature")
SKILLS = CONTENT_SKILLS + FORMAT_SKILLS + STYLE_SKILLS
SIGNATURE = "— SmolLM"
HELD_OUT = ("validation", "test")
VACUOUS = {("sort", "capitals"): "a sorted list has no letters, so any answer would be in capitals"}


@dataclass(frozen=True)
class SkillItem:
    """One prompt of one skill (or of two, for a joint item), its reference answer, and what is scored.

    `skills` names the skills the item needs; `content` the content answers the scorers look for, one per
    content skill, in order; `form` the format skill's name where one applies (else None). A style item's
    `answer` is "" where it rewrites the base's own answer (known only once the base answers `question`, the
    question without the instructions).
    """

    prompt: str
    answer: str
    skills: tuple[str, ...]
    content: tuple[str, ...] = ()
    form: str | None = None
    template: str = field(default="", compare=False)
    question: str = field(default="", compare=False)


# ---------------------------------------------------------------------------------------------
# Content skills: (phrasings by split, a draw of the values, the answer)

UNITS = [("km", "kilometers", "m", "meters", 1000), ("m", "meters", "cm", "centimeters", 100),
         ("cm", "centimeters", "mm", "millimeters", 10), ("kg", "kilograms", "g", "grams", 1000),
         ("l", "liters", "ml", "milliliters", 1000), ("m", "meters", "mm", "millimeters", 1000),
         ("g", "grams", "mg", "milligrams", 1000)]  # fmt: skip
UNITS_PHRASINGS = {
    "train": ["Convert {n} {source} to {target}.", "How many {target} are in {n} {source}?",
              "Change {n} {source} into {target}."],
    "held_out": ["Express {n} {source} in {target}.", "{n} {source} is how many {target}?"],
}  # fmt: skip
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]  # fmt: skip
DATES_PHRASINGS = {
    "train": ["Write {iso} as a date in words.", "Spell out the date {iso}.", "What date is {iso}, written out?"],
    "held_out": ["Give the date {iso} in words.", "Rewrite {iso} with the month's name."],
}
SORT_PHRASINGS = {
    "train": ["Sort from smallest to largest: {numbers}.", "Put these numbers in increasing order: {numbers}.",
              "Order {numbers} from low to high."],
    "held_out": ["Arrange in ascending order: {numbers}.", "List {numbers} from the smallest to the largest."],
}  # fmt: skip


def _units(rng: random.Random, phrasing: str) -> tuple[str, str]:
    short, source, unit, target, factor = rng.choice(UNITS)
    n = rng.randint(2, 99)
    return phrasing.format(n=n, source=source, target=target), f"{n * factor} {unit}"


def _dates(rng: random.Random, phrasing: str) -> tuple[str, str]:
    year, month, day = rng.randint(1950, 2030), rng.randint(1, 12), rng.randint(1, 28)
    return phrasing.format(iso=f"{year}-{month:02d}-{day:02d}"), f"{MONTHS[month - 1]} {day}, {year}"


def _sort(rng: random.Random, phrasing: str) -> tuple[str, str]:
    numbers = rng.sample(range(1, 100), 4)
    return phrasing.format(numbers=", ".join(map(str, numbers))), ", ".join(map(str, sorted(numbers)))


CONTENT: dict[str, tuple[dict[str, list[str]], Callable[[random.Random, str], tuple[str, str]]]] = {
    "units": (UNITS_PHRASINGS, _units),
    "dates": (DATES_PHRASINGS, _dates),
    "sort": (SORT_PHRASINGS, _sort),
}

# ---------------------------------------------------------------------------------------------
# Format skills: an instruction appended to a question, by split, and how the answer is written

FORMAT_PHRASINGS = {
    "json": {"train": ["Reply in JSON.", "Answer as JSON.", "Format the reply as JSON."],
             "held_out": ["Respond with a JSON object.", "Give your answer in JSON format."]},
    "brackets": {"train": ["Put the answer in square brackets.", "Reply inside square brackets."],
                 "held_out": ["Wrap your answer in square brackets.", "Answer between [ and ]."]},
    "signature": {"train": ["Sign your reply.", "Add your signature at the end."],
                  "held_out": ["End with your signature.", "Please sign the answer."]},
}  # fmt: skip


def formatted(form: str, content: str) -> str:
    """`content` written in the format skill `form`'s way."""
    if form == "json":
        return '{"answer": "' + content.replace("\\", "\\\\").replace('"', '\\"') + '"}'
    if form == "brackets":
        return f"[{content}]"
    if form == "signature":
        return f"{content}\n{SIGNATURE}"
    raise ValueError(f"`form` must be one of {', '.join(FORMAT_SKILLS)}, got {form!r}")


WORDS = ["apple", "river", "candle", "garden", "window", "pencil", "tiger", "cloud", "bottle", "forest", "silver",
         "rocket", "button", "planet", "castle", "ladder", "mirror", "orange", "pillow", "violin"]  # fmt: skip
COLOURS = ["red", "blue", "green", "yellow", "black", "white"]
EASY = [  # questions the base answers already: the format expert's content, never a content skill's
    lambda rng: (f"Repeat this word: {(w := rng.choice(WORDS))}.", w),
    lambda rng: (f"Which word comes first in '{(a := rng.choice(WORDS))} {rng.choice(WORDS)}'?", a),
    lambda rng: (f"What colour is mentioned here: the {rng.choice(WORDS)} is {(c := rng.choice(COLOURS))}.", c),
    lambda rng: (f"What is {(a := rng.randint(1, 9))} plus {(b := rng.randint(1, 9))}?", str(a + b)),
    lambda rng: (f"Which is larger, {(pair := rng.sample(range(10, 100), 2))[0]} or {pair[1]}?", str(max(pair))),
]


def _easy_item(rng: random.Random) -> tuple[str, str]:
    return rng.choice(EASY)(rng)


# ---------------------------------------------------------------------------------------------
# Splits


def phrasings(skill: str, split: str) -> list[str]:
    """The templates of `skill` in `split`: the train split's, or the held-out splits' (shared)."""
    check_split(split)
    table = CONTENT[skill][0] if skill in CONTENT else FORMAT_PHRASINGS.get(skill, STYLE_PHRASINGS.get(skill))
    if table is None:
        raise ValueError(f"`skill` must be one of {', '.join(SKILLS)}, got {skill!r}")
    return table["train" if split == "train" else "held_out"]


def _one(skill: str, split: str, rng: random.Random) -> SkillItem:
    template = rng.choice(phrasings(skill, split))
    if skill in CONTENT:
        prompt, answer = CONTENT[skill][1](rng, template)
        return SkillItem(prompt, answer, (skill,), (answer,), None, template)
    if skill in STYLE_SKILLS:
        question = style_question(rng, "train" if split == "train" else "held_out")
        return SkillItem(f"{question} {template}", "", (skill,), (), None, template, question)
    question, content = _easy_item(rng)
    return SkillItem(f"{question} {template}", formatted(skill, content), (skill,), (content,), skill, template)


def _draw(make: Callable[[random.Random], SkillItem], count: int, seed: int, exclude: set[str]) -> list[SkillItem]:
    rng = random.Random(seed)
    items: dict[str, SkillItem] = {}
    for _ in range(200 * count):
        item = make(rng)
        if item.prompt not in exclude:
            items.setdefault(item.prompt, item)
        if len(items) == count:
            return list(items.values())
    raise ValueError(f"only {len(items)} distinct items could be drawn, fewer than the {count} asked for")


def _split_seed(split: str, seed: int, salt: str) -> int:
    return random.Random(f"{salt}:{split}:{seed}").randint(0, 2**31)


def skill_items(skill: str, split: str, count: int, seed: int = 0) -> list[SkillItem]:
    """`count` distinct items of `skill` from `split`'s templates; validation and test never share a prompt."""
    check_split(split)
    check_count(count)
    phrasings(skill, split)  # checks `skill`
    exclude = set()
    if split == "test":  # the validation items of the same seed are kept out of the test split
        exclude = {item.prompt for item in skill_items(skill, "validation", count, seed)}
    return _draw(lambda rng: _one(skill, split, rng), count, _split_seed(split, seed, skill), exclude)


def pair_problem(first: str, second: str) -> str | None:
    """What makes `(first, second)` no pair of `joint_items` (a phrase that names the skill and what is allowed), or
    None for a pair."""
    for order, skill in (("first", first), ("second", second)):
        if skill not in SKILLS:
            return f"the {order} skill {skill!r} has no generator or scorer; the skills are {', '.join(SKILLS)}"
    if first not in CONTENT_SKILLS + STYLE_SKILLS:
        allowed = ", ".join(CONTENT_SKILLS + STYLE_SKILLS)
        return f"the first skill must be a content skill or a style ({allowed}), got {first!r}"
    if first in STYLE_SKILLS and second not in WHOLE_ANSWER_STYLES:
        allowed = ", ".join(WHOLE_ANSWER_STYLES)
        return f"after the style {first!r} the second skill must be a style ({allowed}), got {second!r}"
    if first == second:
        return f"two skills are needed, got {first!r} twice"
    if (first, second) in VACUOUS:
        return f"{first} + {second}: {VACUOUS[first, second]}; pair {second!r} with another skill"
    return None


def pair_kind(first: str, second: str) -> str:
    """The kind of a pair of skills, by what each is: "content × content" (sequential), "content × format",
    "content × style" or "style × style" (`signature` counts as a style beside another style, as a format beside
    content); other pairs are named by both kinds, e.g. "format × format"."""

    def kind(skill: str, other: str) -> str:
        if skill in CONTENT_SKILLS:
            return "content"
        if skill in STYLE_SKILLS or (skill in WHOLE_ANSWER_STYLES and other in STYLE_SKILLS):
            return "style"
        if skill in FORMAT_SKILLS:
            return "format"
        raise ValueError(f"`skill` {skill!r} is none of the skills ({', '.join(SKILLS)})")

    kinds = sorted((kind(first, second), kind(second, first)), key=("content", "format", "style").index)
    return " × ".join(kinds)


def joint_items(first: str, second: str, split: str, count: int, seed: int = 0) -> list[SkillItem]:
    """`count` items that need both skills, from `split`'s templates of each.

    * content + format (simultaneous): the content question with the format's instruction; the reference
      is the content answer in that format;
    * content + style (simultaneous): the content question with the style's instruction; the reference is
      the content answer in that style;
    * content + content (sequential): the first question, then "Then, " and the second; the reference is
      the two answers, one per line, in that order;
    * style + style (`signature` among them, second): a general question with both instructions; no
      reference (the base's own answer, rewritten, is not known here).
    """
    problem = pair_problem(first, second)
    if problem is not None:
        raise ValueError(f"`first`, `second` = {first!r}, {second!r}: {problem}")
    check_split(split)
    check_count(count)

    def make(rng: random.Random) -> SkillItem:
        if first in STYLE_SKILLS:
            question = style_question(rng, "train" if split == "train" else "held_out")
            first_instruction = rng.choice(phrasings(first, split))
            second_instruction = rng.choice(phrasings(second, split))
            prompt = f"{question} {first_instruction} {second_instruction}"
            form = second if second in FORMAT_SKILLS else None
            return SkillItem(prompt, "", (first, second), (), form, first_instruction, question)
        a = _one(first, split, rng)
        if second in FORMAT_SKILLS + STYLE_SKILLS:
            instruction = rng.choice(phrasings(second, split))
            if second in FORMAT_SKILLS:
                answer, form = formatted(second, a.answer), second
            else:
                answer, form = restyled(second, a.answer), None
            return SkillItem(f"{a.prompt} {instruction}", answer, (first, second), a.content, form, a.template)
        b = _one(second, split, rng)
        prompt = f"{a.prompt} Then, {b.prompt[0].lower()}{b.prompt[1:]}"
        return SkillItem(prompt, f"{a.answer}\n{b.answer}", (first, second), a.content + b.content, None, a.template)

    exclude = set()
    if split == "test":
        exclude = {item.prompt for item in joint_items(first, second, "validation", count, seed)}
    return _draw(make, count, _split_seed(split, seed, f"{first}+{second}"), exclude)
