"""The one-skill experts of the real settings, trained from the base and kept in a cache by recipe.

A `SkillRecipe` is an `AdapterRecipe` (`mergecompose.studies.chat_training`) with the skill and the number of
distinct training items, drawn from the skill's train templates (`skill_items(skill, "train", examples)`).
`train_skill_expert` keeps each expert in `CACHE/experts/<skill>-<kind>-<hash>`, the hash of the recipe, the
base's files and the training items, so every setting that uses a skill shares its one expert, and a rerun on
this machine or another finds it again.
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
from mergecompose.studies.skill_pairs.skill_data import SkillItem, skill_items

SkillName = Literal["units", "dates", "sort", "json", "brackets", "signature"]


class SkillRecipe(AdapterRecipe):
    """How one skill's expert is trained: the skill, its training items, and `AdapterRecipe`'s settings."""

    skill: SkillName
    examples: int = Field(400, ge=1)  # distinct training items
    steps: int = Field(120, ge=1)


def training_items(recipe: SkillRecipe) -> list[SkillItem]:
    return skill_items(recipe.skill, "train", recipe.examples, recipe.seed)


def skill_expert_folder(base: str | os.PathLike, recipe: SkillRecipe, cache: str | os.PathLike) -> Path:
    """Where `train_skill_expert` keeps the expert of `recipe` on `base` (nothing is trained)."""
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
    pairs = [(item.prompt, item.answer) for item in training_items(recipe)]
    record = {"base": str(base), "examples": {"kept": len(pairs)}}
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
