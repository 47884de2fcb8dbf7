"""The trainer: AdamW on cross-entropy of the labelled positions, with a tqdm bar.

    loss = mean over labelled positions t of  −log p_θ(labels[t] | input_ids[≤ t], position_ids[≤ t])

The labels are already aligned with the logits (`labels[:, t]` is the target of the logit at t),
so nothing is shifted here; positions labelled `IGNORE_INDEX` carry no target. The learning rate
warms up linearly over `warmup_fraction` of the steps, then follows a cosine to 0 (or stays
constant). Only parameters with `requires_grad` are trained, so the same loop trains a model from
scratch, fine-tunes it fully, or trains a peft LoRA adapter. The loop draws no random numbers
itself (dropout, if the model has any, draws from torch's global generator).
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from peft import LoraConfig, get_peft_model
from pydantic import BaseModel, ConfigDict, Field
from tqdm.auto import tqdm

from mergecompose.core.io import atomic_output_dir, refuse_existing

IGNORE_INDEX = -100  # label of positions that carry no target (cross_entropy's ignore_index)


class OptimizerSettings(BaseModel):
    """AdamW, its learning-rate schedule and gradient clipping."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # lr: .inf trains to NaN

    lr: float = Field(default=3e-3, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_fraction: float = Field(default=0.1, ge=0, lt=1)
    grad_clip: float | None = Field(default=1.0, gt=0)  # max global gradient norm; None: no clipping


@dataclass
class Batch:
    """Right-padded model inputs, `(batch, seq)` each; `labels[:, t]` is the target of the logit at t.

    `attention_mask` and `position_ids` may be None (the model's defaults: attend to every token,
    positions 0, 1, ...).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    labels: torch.Tensor

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            self.input_ids.to(device),
            None if self.attention_mask is None else self.attention_mask.to(device),
            None if self.position_ids is None else self.position_ids.to(device),
            self.labels.to(device),
        )


@dataclass
class TrainingLog:
    steps: int
    seconds: float
    final_loss: float
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) every `log_every` steps, unrounded

    def rounded_losses(self) -> list[float]:
        """The logged losses rounded to 6 decimals, as the records on disk keep them."""
        return [round(loss, 6) for _, loss in self.losses]

    def to_dict(self) -> dict:
        """The log for a record on disk: the losses rounded to 6 decimals."""
        return {**asdict(self), "losses": [(step, round(loss, 6)) for step, loss in self.losses]}


def lr_factor(step: int, total: int, settings: OptimizerSettings) -> float:
    """Multiplier of the base learning rate at `step` (0-based): linear warmup, then cosine or constant."""
    warmup = round(settings.warmup_fraction * total)
    if step < warmup:
        return (step + 1) / warmup
    if settings.schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def train_model(
    model: torch.nn.Module,
    batches: Iterable[Batch],
    settings: OptimizerSettings,
    total_steps: int,
    *,
    description: str = "train",
    progress: bool = True,
    log_every: int = 50,
    autocast: torch.dtype | None = None,
    labelled_logits_only: bool = False,
) -> TrainingLog:
    """Train the parameters of `model` that require grad on `batches`; returns the loss log.

    `batches` yields `total_steps` objects with `.to(device)` giving `input_ids`,
    `attention_mask`, `position_ids` and `labels` (a `Batch`); `total_steps` sets the schedule and
    the progress bar. `settings` needs `lr`, `weight_decay`, `schedule`, `warmup_fraction` and
    `grad_clip` (an `OptimizerSettings`, or any settings with those fields). The loss is logged, unrounded, at
    every `log_every`-th step and the last (`TrainingLog.to_dict` rounds it to 6 decimals for the records on
    disk). The model is left in eval mode.
    `autocast` (e.g. `torch.bfloat16`) runs the forward pass under `torch.autocast` on the model's device: the
    parameters and the optimizer's state stay in their own dtype (float32 master weights), the loss is float32.
    `labelled_logits_only` (for transformers causal LMs, which take `logits_to_keep`): the output layer and the
    loss run only on the positions where some row of the batch has a label, not on the prompt and padding before
    them and after them; the loss is the same.
    """
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    if not parameters:
        raise ValueError("`model` has no parameter with requires_grad=True; nothing to train")
    device = parameters[0].device
    optimizer = torch.optim.AdamW(parameters, lr=settings.lr, weight_decay=settings.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, settings))
    log = TrainingLog(steps=0, seconds=0.0, final_loss=float("nan"))
    started = time.perf_counter()
    model.train()
    bar = tqdm(total=total_steps, desc=description, disable=not progress, leave=False, dynamic_ncols=True)
    for step, batch in enumerate(batches):
        batch = batch.to(device)
        labels, keep = batch.labels, {}  # (B, T)
        if labelled_logits_only:
            columns = (labels != IGNORE_INDEX).any(0).nonzero().squeeze(1)  # (T',) the columns with a label
            labels, keep = labels[:, columns], {"logits_to_keep": columns}  # (B, T')
        with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            logits = model(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids, **keep
            ).logits  # (B, T or T', V)
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if settings.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(parameters, settings.grad_clip)
        optimizer.step()
        scheduler.step()
        value = loss.item()
        if step % log_every == 0 or step == total_steps - 1:
            log.losses.append((step, value))
            bar.set_postfix(loss=f"{value:.4f}")
        bar.update(1)
        log.steps = step + 1
        log.final_loss = value
    bar.close()
    model.eval()
    log.seconds = round(time.perf_counter() - started, 2)
    return log


# ---- LoRA adapters ----------------------------------------------------------------------------------


class LoraTrainingConfig(BaseModel):
    """How `train_lora_expert` trains one adapter (AdamW on the causal-LM loss)."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(default=8, ge=1)
    alpha: float | None = Field(default=None, gt=0, description="lora_alpha; None means alpha = rank (scaling 1)")
    use_rslora: bool = False
    dropout: float = Field(default=0.0, ge=0, lt=1)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    steps: int = Field(default=100, ge=1)
    learning_rate: float = Field(default=1e-3, gt=0)
    seed: int = Field(default=0, ge=0)


@dataclass
class LoraTraining:
    adapter_dir: Path
    losses: list[float]


def train_lora_expert(
    base_model: torch.nn.Module,
    batches: Iterable[Mapping[str, torch.Tensor]],
    out_dir: str | os.PathLike,
    config: LoraTrainingConfig | None = None,
    *,
    overwrite: bool = False,
    progress: bool = True,
) -> LoraTraining:
    """Train a LoRA adapter on a deep copy of `base_model` and save it as a peft folder.

    `batches` yields dicts with `input_ids` (B, T), optional `attention_mask` (B, T) and `labels`
    (B, T; -100 is ignored), as for a transformers causal LM (the logit at t predicts
    labels[:, t + 1]); they are cycled through for `config.steps` AdamW steps of
    `mergecompose.core.training.train_model`. The base model is not modified. The folder (written
    atomically) holds the adapter and `training_config.json` with the losses of every step,
    rounded to 6 decimals.
    """
    config = config or LoraTrainingConfig()
    refuse_existing(out_dir, overwrite)
    batches = list(batches)
    if not batches:
        raise ValueError("`batches` must yield at least one batch, got none")
    for index, batch in enumerate(batches):
        if "input_ids" not in batch or "labels" not in batch:
            raise ValueError(f"`batches[{index}]` must hold `input_ids` and `labels`, got keys {sorted(batch)}")
    torch.manual_seed(config.seed)
    # peft annotates `lora_alpha` as int, but scales by any number (scaling = lora_alpha / r): a float alpha is kept.
    lora_config = LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha if config.alpha is not None else config.rank,  # type: ignore[arg-type]
        use_rslora=config.use_rslora,
        lora_dropout=config.dropout,
        target_modules=config.target_modules,
    )
    peft_model = get_peft_model(copy.deepcopy(base_model), lora_config)
    # AdamW with torch's default weight decay, at a constant rate, without clipping.
    settings = OptimizerSettings(
        lr=config.learning_rate, weight_decay=0.01, schedule="constant", warmup_fraction=0.0, grad_clip=None
    )
    stream = (aligned_batch(batches[step % len(batches)]) for step in range(config.steps))
    log = train_model(
        peft_model, stream, settings, config.steps, description="LoRA training", progress=progress, log_every=1
    )
    with atomic_output_dir(out_dir, overwrite) as folder:
        peft_model.save_pretrained(str(folder))
        record = {"config": config.model_dump(), "losses": log.rounded_losses()}
        (folder / "training_config.json").write_text(json.dumps(record, indent=2))
    return LoraTraining(Path(out_dir), [loss for _, loss in log.losses])


def aligned_batch(batch: Mapping[str, torch.Tensor]) -> Batch:
    """A transformers-style batch (the logit at t predicts labels[:, t + 1]) with labels aligned to the logits."""
    labels = torch.nn.functional.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]  # (B, T)
    return Batch(batch["input_ids"], batch.get("attention_mask"), None, labels)
