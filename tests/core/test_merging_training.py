"""The shared trainer: schedule values, the loss it logs against a hand-computed cross-entropy,
what gets trained, and `train_lora_expert` on top of it."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model

from mergecompose.core.tiny import random_llama
from mergecompose.core.training import (
    IGNORE_INDEX,
    Batch,
    LoraTrainingConfig,
    OptimizerSettings,
    TrainingLog,
    lr_factor,
    train_lora_expert,
    train_model,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_batch(seed: int, rows: int = 4, length: int = 10) -> Batch:
    """Aligned labels: the logit at t predicts input_ids[t + 1]; the last position and row 1's padding carry none."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 64, (rows, length), generator=generator)  # (B, T)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 7:] = 0
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    labels[1, 6:] = IGNORE_INDEX
    position_ids = torch.arange(length).expand(rows, length)
    return Batch(input_ids, attention_mask, position_ids, labels)


def test_labelled_logits_only_trains_exactly_as_the_full_output_layer(tiny_config):
    """The output layer run on the labelled columns only (`labelled_logits_only`) gives the same losses and weights:
    here the first two and the last columns carry no label in any row, so they are left out."""
    batch = random_batch(seed=4)
    batch.labels[:, :2] = IGNORE_INDEX
    batches = [batch, random_batch(seed=5)]
    models = [random_llama(tiny_config, seed=3) for _ in range(2)]
    logs = [
        train_model(
            model, batches, OptimizerSettings(lr=1e-2), 2, progress=False, log_every=1, labelled_logits_only=only
        )
        for model, only in zip(models, (False, True))
    ]
    # Unrounded losses, to float32's order-of-sums error (about 1e-7 relative), far below any real change in them.
    assert [loss for _, loss in logs[0].losses] == pytest.approx([loss for _, loss in logs[1].losses], rel=1e-5)
    for (name, full), (_, kept) in zip(models[0].named_parameters(), models[1].named_parameters()):
        torch.testing.assert_close(kept, full, rtol=1e-5, atol=1e-6, msg=name)


def test_lr_schedule_golden_values():
    settings = OptimizerSettings(warmup_fraction=0.2)  # 10 steps: 2 of warmup, then 8 of cosine
    values = [lr_factor(step, 10, settings) for step in range(10)]
    assert values[0] == pytest.approx(0.5) and values[1] == pytest.approx(1.0) and values[2] == pytest.approx(1.0)
    assert values[6] == pytest.approx(0.5)  # halfway through the cosine
    assert values[9] == pytest.approx(0.5 * (1 + math.cos(math.pi * 7 / 8)))
    constant = OptimizerSettings(warmup_fraction=0.0, schedule="constant")
    assert [lr_factor(step, 10, constant) for step in range(10)] == [1.0] * 10


def test_logged_loss_is_the_cross_entropy_of_the_labelled_positions(tiny_config):
    model = random_llama(tiny_config, seed=3)
    batch = random_batch(seed=0)
    with torch.no_grad():
        logits = (
            copy.deepcopy(model)
            .eval()(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
            .logits.double()
        )  # (B, T, V)
    labelled = batch.labels != IGNORE_INDEX  # (B, T)
    picked = logits.log_softmax(-1).gather(-1, batch.labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, T)
    expected = -(picked[labelled]).mean().item()

    log = train_model(model, [batch] * 7, OptimizerSettings(lr=1e-2), 7, progress=False, log_every=3)
    assert isinstance(log, TrainingLog) and log.steps == 7 and not model.training
    assert [step for step, _ in log.losses] == [0, 3, 6]  # every third step and the last
    assert log.losses[0][1] == pytest.approx(expected, rel=1e-5)  # computed before the first update, unrounded
    assert log.losses[-1][1] == log.final_loss < log.losses[0][1]
    assert log.to_dict()["losses"][-1] == (6, round(log.final_loss, 6))  # the record on disk rounds


def test_ignored_positions_do_not_train(tiny_config):
    # Rows whose labels are all ignored change nothing: the same training as without them.
    batch = random_batch(seed=1)
    first_row = Batch(
        *(tensor[:1] for tensor in (batch.input_ids, batch.attention_mask, batch.position_ids, batch.labels))
    )
    batch.labels[1:] = IGNORE_INDEX
    models = [random_llama(tiny_config, seed=3) for _ in range(2)]
    logs = [
        train_model(model, [data] * 3, OptimizerSettings(lr=1e-2), 3, progress=False, log_every=1)
        for model, data in zip(models, (batch, first_row))
    ]
    assert [loss for _, loss in logs[0].losses] == pytest.approx([loss for _, loss in logs[1].losses], rel=1e-5)
    for name, tensor in models[0].state_dict().items():
        torch.testing.assert_close(tensor, models[1].state_dict()[name], atol=1e-5, rtol=0)


def test_only_parameters_that_require_grad_are_trained(tiny_config):
    base = random_llama(tiny_config, seed=4)
    before = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    train_model(peft_model, [random_batch(seed=2)] * 3, OptimizerSettings(lr=1e-2), 3, progress=False)
    after = peft_model.get_base_model().state_dict()
    for name, tensor in before.items():
        key = (
            name.replace(".weight", ".base_layer.weight")
            if name.replace(".weight", ".base_layer.weight") in after
            else name
        )
        assert torch.equal(after[key], tensor)
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in peft_model.named_parameters() if "lora_B" in n)

    base.requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
        train_model(base, [random_batch(seed=2)], OptimizerSettings(), 1, progress=False)


def test_batch_to_keeps_missing_inputs_missing():
    batch = Batch(torch.ones(1, 3, dtype=torch.long), None, None, torch.zeros(1, 3, dtype=torch.long))
    moved = batch.to("cpu")
    assert moved.attention_mask is None and moved.position_ids is None and torch.equal(moved.input_ids, batch.input_ids)


def test_lora_expert_loss_is_the_transformers_causal_lm_loss(base_model, tmp_path):
    # LoRA's B starts at zero, so the first loss is the base model's own transformers loss.
    torch.manual_seed(0)
    input_ids = torch.randint(3, 64, (3, 9))
    labels = input_ids.clone()
    labels[2, 5:] = IGNORE_INDEX
    config = LoraTrainingConfig(rank=4, steps=3, learning_rate=1e-2, target_modules=["q_proj"])
    training = train_lora_expert(
        base_model, [{"input_ids": input_ids, "labels": labels}], tmp_path / "a", config, progress=False
    )
    with torch.no_grad():
        expected = base_model(input_ids=input_ids, labels=labels).loss.item()
    assert len(training.losses) == 3 and training.losses[0] == pytest.approx(expected, rel=1e-5)
