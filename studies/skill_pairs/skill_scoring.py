"""Scoring an answer to a `SkillItem`: each skill's part, strict and lenient, and a joint item's both parts.

* a **content** part is right, leniently, when the content answer appears in the output (numbers compared
  as numbers, so `7,000` is `7000`; a sorted list as the numbers in that order); strictly, when the
  answer, out of its format, is exactly the reference;
* a **format** part is right, leniently, when the output holds the form anywhere (a JSON object with an
  `answer` string, a `[…]`, a last line with `SmolLM`); strictly, when the whole output is that form
  (parses as `{"answer": "…"}` alone, is one `[…]`, ends with the line `— SmolLM`);
* a **style** part (`style_found`) is right when the whole output is in the style: no lowercase letter
  (`capitals`), starting with `In short:` (`opening`), one sentence (`one_sentence`); strictly and leniently
  alike. Beside `capitals` the content and the signature are found whatever their case, and the strict
  content is compared out of the style (without the opening, case ignored beside `capitals`);
* a **joint** item is right when both its parts are, by the same scorers (`score_item`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from mergecompose.studies.math_code.scoring import Score
from mergecompose.studies.skill_pairs.skill_data import CONTENT_SKILLS, SIGNATURE, SkillItem
from mergecompose.studies.skill_pairs.style_data import OPENING, SENTENCE_END, STYLE_SKILLS

NUMBER = re.compile(r"\d[\d,]*")


@dataclass(frozen=True)
class ItemScore:
    """The item's parts by skill, and the whole: right when every part is."""

    parts: dict[str, Score]

    @property
    def strict(self) -> bool:
        return all(part.strict for part in self.parts.values())

    @property
    def lenient(self) -> bool:
        return all(part.lenient for part in self.parts.values())


def _numbers(text: str) -> list[int]:
    return [int(match.replace(",", "")) for match in NUMBER.findall(text) if match.replace(",", "")]


def content_found(skill: str, reference: str, output: str) -> bool:
    """Whether `output` holds the content answer `reference` of `skill` (lenient)."""
    if skill == "sort":
        wanted, found = _numbers(reference), _numbers(output)
        return any(found[i : i + len(wanted)] == wanted for i in range(len(found) - len(wanted) + 1))
    if skill == "units":
        number, unit = reference.split(" ")
        return int(number) in _numbers(output)
    if skill == "dates":
        month, day, year = reference.replace(",", "").split(" ")
        return month in output and re.search(rf"\b0?{day}\b", output) is not None and year in output
    raise ValueError(f"`skill` must be one of {', '.join(CONTENT_SKILLS)}, got {skill!r}")


def unformatted(form: str | None, output: str) -> str | None:
    """The content of `output` out of the format `form` when the whole output is in it (strict), else None."""
    text = output.strip()
    if form is None:
        return text
    if form == "json":
        try:
            value = json.loads(text)
        except ValueError:
            return None
        ok = isinstance(value, dict) and list(value) == ["answer"] and isinstance(value["answer"], str)
        return value["answer"] if ok else None
    if form == "brackets":
        match = re.fullmatch(r"\[([^\[\]]*)\]", text)
        return match.group(1) if match else None
    if form == "signature":
        lines = text.splitlines()
        return "\n".join(lines[:-1]).strip() if len(lines) >= 2 and lines[-1].strip() == SIGNATURE else None
    raise ValueError(f"`form` must be None or a format skill, got {form!r}")


def form_found(form: str, output: str) -> bool:
    """Whether `output` holds the format `form` somewhere (lenient)."""
    if form == "json":
        for match in re.finditer(r"\{[^{}]*\}", output):
            try:
                value = json.loads(match.group(0))
            except ValueError:
                continue
            if isinstance(value, dict) and isinstance(value.get("answer"), str):
                return True
        return False
    if form == "brackets":
        return re.search(r"\[[^\[\]]+\]", output) is not None
    if form == "signature":
        lines = output.strip().splitlines()
        return bool(lines) and "SmolLM" in lines[-1]
    raise ValueError(f"`form` must be a format skill, got {form!r}")


def _without_signature(text: str) -> str:
    """`text` without a last line that holds the signature (in any case)."""
    lines = text.strip().splitlines()
    if len(lines) >= 2 and "smollm" in lines[-1].casefold():
        return "\n".join(lines[:-1]).strip()
    return text.strip()


def style_found(style: str, output: str) -> bool:
    """Whether the whole `output` (but a closing signature line) is in `style`."""
    text = _without_signature(output)
    if style == "capitals":
        return bool(text) and not any(char.islower() for char in text)  # an answer of digits only passes
    if style == "opening":
        return text.casefold().startswith(OPENING.casefold())
    if style == "one_sentence":
        return bool(text) and len(SENTENCE_END.split(text)) == 1
    raise ValueError(f"`style` must be one of {', '.join(STYLE_SKILLS)}, got {style!r}")


def score_item(item: SkillItem, output: str) -> ItemScore:
    """`output` scored against `item`: one part per skill the item needs."""
    if not isinstance(output, str):
        raise ValueError(f"`output` must be a str, got {type(output).__name__}")
    capitals = "capitals" in item.skills
    inner = unformatted(item.form, output)
    if inner is not None and "opening" in item.skills and inner.casefold().startswith(OPENING.casefold()):
        inner = inner[len(OPENING) :].strip()
    content_skills = [skill for skill in item.skills if skill in CONTENT_SKILLS]
    parts = {}
    if content_skills:
        strict_lines = None if inner is None else inner.strip().splitlines()
        for index, (skill, reference) in enumerate(zip(content_skills, item.content)):
            strict = strict_lines is not None and len(strict_lines) == len(content_skills)
            line = strict_lines[index].strip() if strict else ""  # type: ignore[index]
            strict = strict and (line.casefold() == reference.casefold() if capitals else line == reference)
            fold = str.casefold if capitals else str  # beside capitals, the content in any case
            parts[skill] = Score(strict, content_found(skill, fold(reference), fold(output)))
    if item.form is not None:
        found = form_found(item.form, output)
        if capitals and item.form == "signature":
            lines = output.strip().splitlines()
            found = bool(lines) and "smollm" in lines[-1].casefold()
        parts[item.form] = Score(inner is not None, found)
    for style in (skill for skill in item.skills if skill in STYLE_SKILLS):
        found = style_found(style, output)
        parts[style] = Score(found, found)
    return ItemScore(parts)
