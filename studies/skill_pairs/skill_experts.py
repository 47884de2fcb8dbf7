"""The one-skill experts of the real settings, trained from the base and kept in a cache by recipe.

A `SkillRecipe` is an `AdapterRecipe` (`mergecompose.studies.chat_training`) with the skill and the number of
distinct training items, drawn from the skill's train templates (`skill_items(skill, "train", examples)`).
`train_skill_expert` keeps each expert in `CACHE/experts/<skill>-<kind>-<hash>`, the hash of the recipe, the
base's files and the training items, so every setting that uses a skill shares its one expert, and a rerun on
this machine or another finds it again.

A style expert (`style_data`) is trained on the base's own answers: the base answers each training item's
question alone (greedy, `STYLE_ANSWER_TOKENS` at most, cut to whole sentences), and the expert learns the
question with the style's instruction → that answer rewritten in the style. The base's answers are part of the
training and its time; the cache key names them by the base, the questions and the token budget.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergecompose.studies.chat_training import AdapterRecipe, expert_key, resolved, train_on_pairs, whole_folder
from mergecompose.studies.skill_pairs.setting_run import model_answers
from mergecompose.studies.skill_pairs.skill_data import SkillItem, skill_items
from mergecompose.studies.skill_pairs.style_data import STYLE_SKILLS, restyled, whole_sentences

SkillName = Literal["units", "dates", "sort", "json", "brackets", "signature", "capitals", "opening", "one_sentence"]
STYLE_ANSWER_TOKENS = 40  # the base's own answers, before they are cut to whole sentences


class SkillRecipe(AdapterRecipe):
    """How one skill's expert is trained: the skill, its training items, and `AdapterRecipe`'s settings."""

    skill: SkillName
    examples: int = Field(400, ge=1)  # distinct training items
    steps: int = Field(120, ge=1)


def training_items(recipe: SkillRecipe) -> list[SkillItem]:
    return skill_items(recipe.skill, "train", recipe.examples, recipe.seed)


def skill_expert_folder(base: str | os.PathLike, recipe: SkillRecipe, cache: str | os.PathLike) -> Path:
    """Where `train_skill_expert` keeps the expert of `recipe` on `base` (nothing is trained)."""
    if recipe.skill in STYLE_SKILLS:  # the answers are the base's own, rewritten: named by what makes them
        data = [[item.prompt, f"{recipe.skill}(base answer to {item.question!r}, {STYLE_ANSWER_TOKENS} tokens)"]
                for item in training_items(recipe)]  # fmt: skip
    else:
        data = [[item.prompt, item.answer] for item in training_items(recipe)]
    key = expert_key(resolved(recipe).model_dump(mode="json"), base, data)
    return Path(cache) / "experts" / f"{recipe.skill}-{recipe.kind}-{key}"


def train_skill_expert(
    base: str | os.PathLike, recipe: SkillRecipe, cache: str | os.PathLike, *, progress: bool = True
) -> Path:
    """The expert of `recipe` trained from the checkpoint folder `base`, from the cache or trained now."""
    folder = skill_expert_folder(base, recipe, cache)  # its key draws every training item: once
    if whole_folder(folder) is not None:
        return folder
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    items = training_items(recipe)
    record: dict = {"base": str(base)}
    if recipe.skill in STYLE_SKILLS:
        model.eval()
        own = model_answers(model, tokenizer, [item.question for item in items], STYLE_ANSWER_TOKENS, 32)
        cut = [(item, whole_sentences(answer)) for item, answer in zip(items, own)]
        # An empty answer (the base said nothing) has nothing to rewrite.
        pairs = [(item.prompt, restyled(recipe.skill, answer)) for item, answer in cut if answer]
        seconds = round(time.perf_counter() - started, 1)
        record["base_answers"] = {"seconds": seconds, "empty": len(items) - len(pairs), "first": pairs[:3]}
    else:
        pairs = [(item.prompt, item.answer) for item in items]
    record["examples"] = {"kept": len(pairs)}
    return train_on_pairs(model, tokenizer, pairs, recipe, folder, f"{recipe.skill} expert", progress, record, started)


BAR_MARGIN = 0.20  # an expert is real at ≥ the base's lenient score + 20 points ...
BAR_HIGH = 0.90  # ... or at ≥ 90 % where the base is already high


def expert_bar(base_lenient: float) -> float:
    """The lenient score an expert must reach on its own held-out split: base + 20 points, at most 90 %."""
    return min(base_lenient + BAR_MARGIN, BAR_HIGH)


def check_expert_bar(skill: str, base: dict[str, float], expert: dict[str, float]) -> None:
    """Refuse an expert below its bar, in one line naming both scores (`{"lenient", "strict"}` fractions each)."""
    bar = expert_bar(base["lenient"])
    if expert["lenient"] < bar:
        raise ValueError(
            f"the `{skill}` expert is below its bar: lenient {expert['lenient']:.1%} (strict {expert['strict']:.1%}) "
            f"on its held-out split, against the base's {base['lenient']:.1%} (strict {base['strict']:.1%}); an "
            f"expert needs ≥ {bar:.1%} (the base + {BAR_MARGIN:.0%} points, or {BAR_HIGH:.0%}): train it longer "
            "or replace the skill"
        )
