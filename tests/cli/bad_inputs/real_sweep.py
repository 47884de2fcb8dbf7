"""Bad input to `mergecompose real-sweep`, refused by its pre-flight before any expert trains."""

from __future__ import annotations

import shutil

import yaml

from bad_inputs import Case, Cli
from mergecompose.analysis.data import char_tokenizer

VALID = {
    "name": "bad",
    "base": "smollm2-135m-instruct",
    "settings": [["units", "json"]],
}


def _config(**changes):
    def build(env):
        config = {**VALID, **changes}
        path = env.tmp / "real.yaml"
        path.write_text(yaml.safe_dump(config))
        return Cli(["real-sweep", str(path), "--out", str(env.tmp / "out")], inputs=[path])

    return build


def _base_without_a_chat_format(env):
    """A checkpoint whose tokenizer (characters) has no chat format: the skills' data cannot be written for it."""
    base = env.tmp / "base_without_chat"
    shutil.copytree(env.checkpoints / "base", base)
    char_tokenizer("abc").save_pretrained(base)
    return _config(base=str(base))(env)


CASES = [
    Case(
        "real-sweep-a-recipe-that-sets-the-skill",
        "traceback",
        _config(recipe={"skill": "units"}),
        r"`recipe` key 'skill' is set for each expert by the sweep; the recipe's keys are ",
    ),
    Case(
        "real-sweep-a-recipe-key-that-is-not-text",
        "traceback",
        _config(recipe={1: 10}),
        r"`recipe` key 1 is not a recipe field",
    ),
    Case(
        "real-sweep-an-unknown-merge-method",
        "silent",
        _config(merges={"tie": {"lam": [1.0]}}),
        r"unknown merge methods \['tie'\]; valid: ",
    ),
    Case(
        "real-sweep-a-part-without-a-scorer",
        "clear",
        _config(settings=[["units", "french"]]),
        r"`settings\[0\]`: the second skill 'french' has no generator or scorer; the skills are units, dates",
    ),
    Case(
        "real-sweep-a-format-first",
        "clear",
        _config(settings=[["json", "units"]]),
        r"`settings\[0\]`: the first skill must be a content skill or a style \(units, dates, sort, capitals, "
        r"opening, one_sentence\), got 'json'",
    ),
    Case(
        "real-sweep-one-skill-twice",
        "clear",
        _config(settings=[["units", "units"]]),
        r"`settings\[0\]`: two skills are needed, got 'units' twice",
    ),
    Case(
        "real-sweep-a-recipe-field-that-does-not-exist",
        "clear",
        _config(recipe={"stepz": 10}),
        r"`recipe` key 'stepz' is not a recipe field; the recipe's keys are ",
    ),
    Case(
        "real-sweep-a-grid-of-four-points",
        "clear",
        _config(merges={"task_arithmetic": {"lam": [0.25, 0.5, 1.0, 1.5]}}),
        r"`merges.task_arithmetic` must have at most 3 grid points, got 4",
    ),
    Case(
        "real-sweep-a-base-that-is-neither",
        "clear",
        _config(base="./no_such_folder"),
        r"`base` '\./no_such_folder': no such folder",
    ),
    Case(
        "real-sweep-a-base-without-a-chat-format",
        "misleading",
        _base_without_a_chat_format,
        r"^`base` '[^']*base_without_chat': `tokenizer` must be a ChatML tokenizer with its chat template",
    ),
]
