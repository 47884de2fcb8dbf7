"""The trainer: AdamW on cross-entropy of the labelled positions, seeded, with a tqdm bar.

    loss = mean over labelled positions t of  −log p_θ(labels[t] | input_ids[≤ t], position_ids[≤ t])

The labels are already aligned with the logits (see `tasks.formats`), so nothing is shifted
here. The learning rate warms up linearly over `warmup_fraction` of the steps, then follows a
cosine to 0 (or stays constant). Only parameters with `requires_grad` are trained, so the same
loop trains a model from scratch, fine-tunes it fully, or trains a peft LoRA adapter.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from tasks.config import TrainingSettings
from tasks.formats import IGNORE_INDEX


@dataclass
class TrainingLog:
    steps: int
    seconds: float
    final_loss: float
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) every `log_every` steps

    def to_dict(self) -> dict:
        return asdict(self)


def lr_factor(step: int, total: int, settings: TrainingSettings) -> float:
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
    batches,
    settings: TrainingSettings,
    description: str = "train",
    progress: bool = True,
    log_every: int = 50,
) -> TrainingLog:
    """Train the parameters of `model` that require grad on `batches`; returns the loss log.

    The model is left in eval mode. `batches` yields `Batch`es (`settings.total_steps` of them).
    """
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    if not parameters:
        raise ValueError("`model` has no parameter with requires_grad=True; nothing to train")
    device = parameters[0].device
    optimizer = torch.optim.AdamW(parameters, lr=settings.lr, weight_decay=settings.weight_decay)
    total = settings.total_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total, settings))
    log = TrainingLog(steps=0, seconds=0.0, final_loss=float("nan"))
    started = time.perf_counter()
    model.train()
    bar = tqdm(total=total, desc=description, disable=not progress, leave=False, dynamic_ncols=True)
    for step, batch in enumerate(batches):
        batch = batch.to(device)
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), batch.labels.flatten(), ignore_index=IGNORE_INDEX
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if settings.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(parameters, settings.grad_clip)
        optimizer.step()
        scheduler.step()
        value = loss.item()
        if step % log_every == 0 or step == total - 1:
            log.losses.append((step, round(value, 6)))
            bar.set_postfix(loss=f"{value:.4f}")
        bar.update(1)
        log.steps = step + 1
        log.final_loss = value
    bar.close()
    model.eval()
    log.seconds = round(time.perf_counter() - started, 2)
    return log
