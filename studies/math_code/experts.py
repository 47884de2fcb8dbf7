"""The study's experts: a math expert and a code expert trained here from the real base, cached by recipe.

A recipe (`ExpertRecipe`) names the skill, the kind (a LoRA adapter on all seven projections, or a
full fine-tune), the number of distinct training problems and the optimiser's settings. The
training set is `examples` problems of the skill's train split (templates disjoint from the
validation and test splits), as chat conversations with `SYSTEM_PROMPT`; the loss is on the
assistant's tokens and the closing `<|im_end|>` (`training_batch`). Each step takes `batch_size`
examples, in an order reshuffled every pass (seeded); AdamW with linear warm-up and a cosine to 0,
gradients clipped at norm 1, the forward pass under bfloat16 autocast with float32 weights where the
CPU has fast bfloat16 kernels (`autocast: auto`, `mergecompose.core.precision`), in float32 elsewhere;
`autocast: bfloat16` forces it, `autocast: null` trains in float32.

`train_expert` keeps each trained expert in `CACHE/experts/<skill>-<kind>-<hash>`, the hash of the
recipe, of the base's files (names, sizes, modification times) and of the training problems: a rerun
with the same recipe, base and data finds it again; a changed recipe, base or data generator trains
anew. The folder is written atomically with a manifest (checked on reuse) and `training.json` (the
recipe, the losses, the seconds).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergecompose.studies.chat_training import (
    AdapterRecipe,
    autocast_dtype,
    expert_key,
    resolved,
    train_on_pairs,
    whole_folder,
)
from mergecompose.studies.math_code.chat_data import end_of_turn_id, generation_inputs
from mergecompose.studies.math_code.code_problems import code_split
from mergecompose.studies.math_code.math_problems import expanded_arithmetic, math_split
from mergecompose.studies.math_code.scoring import score_code, score_math


class ExpertRecipe(AdapterRecipe):
    """How one expert is trained from the base (see the module docstring)."""

    skill: Literal["math", "code"]
    examples: int = Field(1200, ge=1)  # distinct training problems (code's train templates hold 385)
    # The answers trained on: the problems' reference solutions, or the base's own answers that are right
    # (`samples` drawn per problem at `temperature`, kept when their lenient score passes: rejection sampling).
    answers: Literal["reference", "sampled"] = "reference"
    # Math references as written ("direct"), or with each two-number step worked out by place value
    # ("expanded": `math_problems.expanded_arithmetic`).
    arithmetic: Literal["direct", "expanded"] = "direct"
    # Math only: each procedural train template taken this many times a turn (`math_split`); 1: every
    # template's share equal (the 12 fixed templates then make 3/4 of the problems).
    procedural_weight: int = Field(1, ge=1)
    # Math only: the train template `problem_types` (the standard types of one-step word problems, chained)
    # added, this many times a turn (`math_split`); 0: the train split's templates only.
    types_weight: int = Field(0, ge=0)
    samples: int = Field(4, ge=1)
    temperature: float = Field(0.7, gt=0)
    max_new_tokens: int = Field(256, ge=1)

    @model_validator(mode="after")
    def _math_fields_are_for_math(self) -> ExpertRecipe:
        if self.arithmetic != "direct" and self.skill != "math":
            raise ValueError(f"`arithmetic` must be 'direct' for a {self.skill} expert, got {self.arithmetic!r}")
        if self.procedural_weight != 1 and self.skill != "math":
            raise ValueError(f"`procedural_weight` must be 1 for a {self.skill} expert, got {self.procedural_weight}")
        if self.types_weight != 0 and self.skill != "math":
            raise ValueError(f"`types_weight` must be 0 for a {self.skill} expert, got {self.types_weight}")
        return self


def _math_train_problems(recipe: ExpertRecipe) -> list:
    return math_split("train", recipe.examples, recipe.seed, recipe.procedural_weight, recipe.types_weight)


def training_pairs(recipe: ExpertRecipe) -> list[tuple[str, str]]:
    """The recipe's (prompt, reference answer) conversations: `examples` distinct train-split problems of its skill."""
    if recipe.skill == "math":
        worked = expanded_arithmetic if recipe.arithmetic == "expanded" else str
        return [(problem.prompt, worked(problem.solution)) for problem in _math_train_problems(recipe)]
    return [(problem.prompt, problem.answer) for problem in code_split("train", recipe.examples, recipe.seed)]


def sampled_pairs(model, tokenizer, recipe: ExpertRecipe, batch_size: int = 32) -> tuple[list[tuple[str, str]], dict]:
    """The base's own right answers to the recipe's train problems: `samples` completions per problem drawn at
    `temperature` (seeded), kept where their lenient score passes (distinct answers only); and the counts."""
    if recipe.skill == "math":
        problems: list = _math_train_problems(recipe)
    else:
        problems = code_split("train", recipe.examples, recipe.seed)
    prompts = [problem.prompt for problem in problems for _ in range(recipe.samples)]
    owners = [problem for problem in problems for _ in range(recipe.samples)]
    torch.manual_seed(recipe.seed)
    outputs: list[str] = []
    model.eval()
    for start in range(0, len(prompts), batch_size):
        inputs = generation_inputs(tokenizer, prompts[start : start + batch_size])
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_dtype(recipe) is not None):
            generated = model.generate(
                **inputs,
                do_sample=True,
                temperature=recipe.temperature,
                top_p=1.0,
                top_k=0,
                max_new_tokens=recipe.max_new_tokens,
                pad_token_id=end_of_turn_id(tokenizer),
                eos_token_id=end_of_turn_id(tokenizer),
            )
        outputs += tokenizer.batch_decode(generated[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    if recipe.skill == "math":
        right = [score_math(output, problem.answer).lenient for output, problem in zip(outputs, owners)]
    else:
        right = [score.lenient for score in score_code(outputs, owners)]
    pairs = list(
        dict.fromkeys((problem.prompt, output.strip()) for output, problem, ok in zip(outputs, owners, right) if ok)
    )
    solved = len({prompt for prompt, _ in pairs})
    counts = {"drawn": len(outputs), "right": sum(right), "kept": len(pairs), "problems_solved": solved}
    if not pairs:
        raise ValueError(
            f"`answers: sampled`: none of the base's {len(outputs)} answers to {len(problems)} {recipe.skill} problems "
            "is right; train on the references (`answers: reference`) or draw more (`samples`)"
        )
    return pairs, counts


# Fields added after experts were cached: keyed only away from these values.
KEYED_SINCE = {"procedural_weight": 1, "types_weight": 0}


def recipe_key(recipe: ExpertRecipe) -> dict:
    """The recipe as its cache key holds it: `autocast: auto` as what it resolves to (an expert trained in
    bfloat16 is not one trained in float32), and a field added since (`KEYED_SINCE`) only where it is not at the
    value that gives the old behaviour, so an expert cached before the field existed is found again."""
    fields = resolved(recipe).model_dump(mode="json")
    return {name: value for name, value in fields.items() if KEYED_SINCE.get(name, object()) != value}


def expert_folder(base: str | os.PathLike, recipe: ExpertRecipe, cache: str | os.PathLike) -> Path:
    """Where `train_expert` keeps the expert of `recipe` on `base` (nothing is trained).

    The key holds the recipe, the base's files and the training problems themselves, so a change to a
    data generator trains anew instead of reusing an expert trained on other problems.
    """
    key = expert_key(recipe_key(recipe), base, [list(pair) for pair in training_pairs(recipe)])
    return Path(cache) / "experts" / f"{recipe.skill}-{recipe.kind}-{key}"


def cached_expert(base: str | os.PathLike, recipe: ExpertRecipe, cache: str | os.PathLike) -> Path | None:
    """The trained expert's folder if the cache holds it whole (its manifest checks out), else None."""
    return whole_folder(expert_folder(base, recipe, cache))


def train_expert(
    base: str | os.PathLike, recipe: ExpertRecipe, cache: str | os.PathLike, *, progress: bool = True
) -> Path:
    """The expert of `recipe` trained from the checkpoint folder `base`: a peft adapter folder (`kind: lora`)
    or a full checkpoint with the base's tokenizer (`kind: full`), from the cache or trained now."""
    folder = expert_folder(base, recipe, cache)  # its key draws every training problem: once
    if whole_folder(folder) is not None:
        return folder
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    started = time.perf_counter()
    if recipe.answers == "sampled":
        pairs, counts = sampled_pairs(model, tokenizer, recipe)
    else:
        pairs, counts = training_pairs(recipe), {"kept": recipe.examples}
    record = {"base": str(base), "examples": counts}
    return train_on_pairs(model, tokenizer, pairs, recipe, folder, f"{recipe.skill} expert", progress, record, started)
