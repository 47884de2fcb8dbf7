"""`decide`'s labelled joint task: a JSONL of prompts with references, and the scorer that reads them.

A task file holds one JSON object per line, `{"prompt": str, "reference": ...}`; the reference is whatever the
scorer reads. The scorers (`SCORERS`, or the user's own):

* `skills` / `skills-strict`: the real settings' scorer (`mergecompose.studies.skill_pairs.skill_scoring`), lenient
  or strict; the reference is an object `{"answer": str, "skills": [str, ...], "content": [str, ...],
  "form": str | null}`, as `joint_task_records` writes it;
* `exact`: the output, stripped, equals the reference, a string, stripped;
* `module:function`: the user's own, imported by its path: `function(prompt, output, reference) -> bool`.

Everything here is checked before any model loads: every line, every reference against its scorer's needs, and
the user's scorer, imported and found callable.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mergecompose.core.boundary import read_text_file
from mergecompose.core.io import jsonl_values
from mergecompose.studies.skill_pairs.skill_data import SKILLS, SkillItem, joint_items
from mergecompose.studies.skill_pairs.skill_scoring import score_item

Scorer = Callable[[str, str, Any], bool]


@dataclass(frozen=True)
class TaskItem:
    """One prompt of the joint task and its reference (as the task file gives it)."""

    prompt: str
    reference: Any


def skill_item(prompt: str, reference: Any) -> SkillItem:
    """The `SkillItem` a `skills` reference describes; a ValueError naming what is missing or wrong."""
    if not isinstance(reference, dict):
        raise ValueError(
            f"a `skills` reference must be an object with answer, skills, content, form; got {reference!r:.80}"
        )
    unknown = sorted(set(reference) - {"answer", "skills", "content", "form"})
    if unknown:
        raise ValueError(f"a `skills` reference has unknown keys {unknown}; it holds answer, skills, content, form")
    skills, content, form = reference.get("skills"), reference.get("content", []), reference.get("form")
    if not isinstance(skills, list) or not skills or not all(skill in SKILLS for skill in skills):
        raise ValueError(f"a `skills` reference's `skills` must list skills of {list(SKILLS)}, got {skills!r}")
    if not isinstance(content, list) or not all(isinstance(part, str) and part for part in content):
        raise ValueError(f"a `skills` reference's `content` must be a list of non-empty strings, got {content!r:.80}")
    if form is not None and form not in skills:
        raise ValueError(f"a `skills` reference's `form` must be null or one of its skills {skills}, got {form!r}")
    expected = len([skill for skill in skills if skill != form])
    if len(content) != expected:
        raise ValueError(
            f"a `skills` reference's `content` must hold one answer per content skill ({expected}), got {len(content)}"
        )
    return SkillItem(prompt, str(reference.get("answer", "")), tuple(skills), tuple(content), form)


def _skills(strict: bool) -> Scorer:
    def score(prompt: str, output: str, reference: Any) -> bool:
        result = score_item(skill_item(prompt, reference), output)
        return result.strict if strict else result.lenient

    return score


def _exact(prompt: str, output: str, reference: Any) -> bool:
    return output.strip() == str(reference).strip()


def _check_exact(reference: Any) -> None:
    if not isinstance(reference, str):
        raise ValueError(f"an `exact` reference must be a string, got {reference!r:.80}")


def _check_skills(reference: Any) -> None:
    skill_item("", reference)


# name -> (the scorer, the check of one reference, what a reference is)
SCORERS: dict[str, tuple[Scorer, Callable[[Any], None]]] = {
    "skills": (_skills(strict=False), _check_skills),
    "skills-strict": (_skills(strict=True), _check_skills),
    "exact": (_exact, _check_exact),
}


def load_scorer(name: str) -> tuple[Scorer, Callable[[Any], None] | None]:
    """A built-in scorer by name, or the user's `module:function` imported (found by its path, never registered)."""
    if name in SCORERS:
        return SCORERS[name]
    if ":" not in name:
        raise ValueError(
            f"`--scorer` {name!r} is not a scorer: give one of {', '.join(SCORERS)}, or your own as "
            "`module:function` (function(prompt, output, reference) -> bool)"
        )
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"`--scorer` {name!r} must be `module:function`, both parts named")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any failure of the user's import is reported in one line
        raise ValueError(
            f"`--scorer` {name!r}: module {module_name!r} does not import ({type(error).__name__}: {error})"
        ) from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(f"`--scorer` {name!r}: module {module_name!r} has no function {attribute!r}")
    try:
        inspect.signature(function).bind("prompt", "output", "reference")
    except (TypeError, ValueError):
        raise ValueError(
            f"`--scorer` {name!r} must take (prompt, output, reference); its signature is {inspect.signature(function)}"
        ) from None
    return function, None


def read_task(path: str | os.PathLike, argument: str, check_reference: Callable[[Any], None] | None) -> list[TaskItem]:
    """The items of a task file, every line checked (a prompt, a reference its scorer can read)."""
    text = read_text_file(path, argument).removeprefix("\ufeff")
    items = []
    for number, record in jsonl_values(text, argument, path):
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
            raise ValueError(
                f"`{argument}` {str(path)!r} line {number} must be an object with a non-empty string `prompt`, "
                f"got {json.dumps(record)[:80]!r}"
            )
        if record.get("reference") is None:
            raise ValueError(
                f"`{argument}` {str(path)!r} line {number} has no `reference`: decide needs a labelled task "
                '({"prompt": ..., "reference": ...} on every line)'
            )
        if check_reference is not None:
            try:
                check_reference(record["reference"])
            except ValueError as error:
                raise ValueError(f"`{argument}` {str(path)!r} line {number}: {error}") from None
        items.append(TaskItem(record["prompt"], record["reference"]))
    if not items:
        raise ValueError(f"`{argument}` {str(path)!r} holds no item")
    return items


def joint_task_records(first: str, second: str, split: str, count: int, seed: int = 0) -> list[dict]:
    """A real setting's joint split (`skill_data.joint_items`) as task records for the `skills` scorer."""
    return [
        {
            "prompt": item.prompt,
            "reference": {
                "answer": item.answer,
                "skills": list(item.skills),
                "content": list(item.content),
                "form": item.form,
            },
        }
        for item in joint_items(first, second, split, count, seed)
    ]


def task_text(records: list[dict]) -> str:
    return "".join(json.dumps(record) + "\n" for record in records)
