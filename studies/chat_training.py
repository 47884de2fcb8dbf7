"""Training an expert of a chat model on (prompt, answer) conversations: the part every real-model study shares.

`AdapterRecipe` holds the optimiser's and the adapter's settings (a LoRA adapter on all seven projections,
or a full fine-tune); a study's recipe adds its skill and its data. `train_on_pairs` trains a loaded base
on the conversations (`math_code.chat_data.training_batch`: the loss on the assistant's tokens and the
closing `<|im_end|>`), `batch_size` conversations a step in an order reshuffled every pass (seeded), AdamW
with linear warm-up and a cosine to 0, gradients clipped at norm 1, under bfloat16 autocast with float32
weights where the CPU has fast bfloat16 kernels (`autocast: auto`), and writes the expert atomically with a
manifest and `training.json` (the recipe, the losses, the seconds).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import torch
from peft import LoraConfig, get_peft_model
from pydantic import BaseModel, ConfigDict, Field

from mergecompose.core.io import atomic_output_dir, atomic_write_text, manifest_problem, write_manifest
from mergecompose.core.precision import AUTO, fast_bfloat16
from mergecompose.core.training import Batch, OptimizerSettings, aligned_batch, train_model
from mergecompose.experiments.compare_config import fingerprint
from mergecompose.experiments.lm_eval.lm_eval_systems import source_identity
from mergecompose.studies.math_code.chat_data import training_batch

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TRAINING_RECORD = "training.json"


class AdapterRecipe(BaseModel):
    """The settings of one expert's training run, whatever its skill (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    kind: Literal["lora", "full"] = "lora"
    steps: int = Field(150, ge=1)
    batch_size: int = Field(8, ge=1)
    learning_rate: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(10, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    rank: int = Field(16, ge=1)  # LoRA only
    alpha: float = Field(32.0, gt=0)  # LoRA only: scaling alpha / rank
    target_modules: list[str] = Field(default_factory=lambda: list(ALL_PROJECTIONS), min_length=1)
    seed: int = Field(0, ge=0)
    autocast: Literal["auto", "bfloat16"] | None = "auto"


def resolved(recipe: AdapterRecipe) -> AdapterRecipe:
    """`recipe` with `autocast: auto` made what it means on this CPU: 'bfloat16' where it is fast, else None."""
    if recipe.autocast != AUTO:
        return recipe
    return recipe.model_copy(update={"autocast": "bfloat16" if fast_bfloat16("cpu") else None})


def autocast_dtype(recipe: AdapterRecipe) -> torch.dtype | None:
    return torch.bfloat16 if resolved(recipe).autocast == "bfloat16" else None


def expert_key(recipe_key: dict, base: str | os.PathLike, data: list) -> str:
    """The cache key of an expert: its recipe (as the study keys it), the base's files (names, sizes, modification
    times) and its training data, so a changed recipe, base or data generator trains anew."""
    return fingerprint({"recipe": recipe_key, "base": source_identity(str(base)), "data": fingerprint(data)})


def whole_folder(folder: Path) -> Path | None:
    """`folder` if the cache holds it whole (its manifest checks out), else None."""
    return folder if folder.is_dir() and manifest_problem(folder) is None else None


def train_on_pairs(
    model,
    tokenizer,
    pairs: Sequence[tuple[str, str]],
    recipe: AdapterRecipe,
    folder: str | os.PathLike,
    description: str,
    progress: bool = True,
    record: dict | None = None,
    started: float | None = None,
) -> Path:
    """Train the loaded base `model` on `pairs` as `recipe` says and write the expert to `folder`, atomically.

    A peft adapter folder (`kind: lora`) or a full checkpoint with the tokenizer (`kind: full`), with a
    manifest and `training.json`: `record` (e.g. the base and the data's counts), the resolved recipe, the
    seconds since `started` (default: now) and the losses. Returns `folder`.
    """
    if not pairs:
        raise ValueError("`pairs` must hold at least one (prompt, answer) conversation, got none")
    started = time.perf_counter() if started is None else started
    if recipe.kind == "lora":
        config = LoraConfig(r=recipe.rank, lora_alpha=recipe.alpha, target_modules=list(recipe.target_modules))
        model = get_peft_model(model, config)
    settings = OptimizerSettings(
        lr=recipe.learning_rate,
        weight_decay=recipe.weight_decay,
        schedule="cosine",
        warmup_fraction=min(recipe.warmup_steps / recipe.steps, 0.99),
        grad_clip=1.0,
    )
    torch.manual_seed(recipe.seed)
    log = train_model(
        model,
        pair_batches(tokenizer, pairs, recipe),
        settings,
        recipe.steps,
        description=f"{description} ({recipe.kind})",
        progress=progress,
        log_every=1,
        autocast=autocast_dtype(recipe),
        labelled_logits_only=True,
    )
    seconds = round(time.perf_counter() - started, 1)
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output_dir(folder, overwrite=True) as out:
        if recipe.kind == "lora":
            model.save_pretrained(str(out))
        else:
            model.save_pretrained(out)
            tokenizer.save_pretrained(str(out))
        written = {"recipe": resolved(recipe).model_dump(mode="json"), **(record or {})}
        written.update({"seconds": seconds, "losses": log.rounded_losses()})
        atomic_write_text(out / TRAINING_RECORD, json.dumps(written, indent=2) + "\n")
        write_manifest(out)
    return folder


def pair_batches(tokenizer, pairs: Sequence[tuple[str, str]], recipe: AdapterRecipe) -> Iterator[Batch]:
    """`recipe.steps` batches of `batch_size` conversations, each pass over `pairs` in a new seeded order."""
    rng = random.Random(recipe.seed)
    order: list[int] = []
    for _ in range(recipe.steps):
        while len(order) < recipe.batch_size:
            fresh = list(range(len(pairs)))
            rng.shuffle(fresh)
            order.extend(fresh)
        chosen, order = order[: recipe.batch_size], order[recipe.batch_size :]
        yield aligned_batch(training_batch(tokenizer, [pairs[index] for index in chosen]))
