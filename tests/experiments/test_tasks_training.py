"""The trainer: schedule values, training data, what gets trained, and the typed settings."""

from __future__ import annotations

import math

import pytest
import torch
from peft import get_peft_model

from mergecompose.core.training import lr_factor, train_model
from mergecompose.experiments.compare_config import LoraSettings, ModelSettings, TrainingSettings
from mergecompose.experiments.formats import IGNORE_INDEX, SequenceFormat
from mergecompose.experiments.models import build_model, lora_config
from mergecompose.experiments.tokenizer import build_tokenizer, decode_ids
from mergecompose.experiments.training_strings import is_held_out
from mergecompose.studies.letters.letters_task_type import letter_training_strings

ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ "
TINY = ModelSettings(hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=64)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(ALPHABET)


@pytest.fixture(scope="module")
def fmt(tokenizer):
    return SequenceFormat(
        "seq2seq", "coupled", True, 64, tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.sep_token_id
    )


def test_lr_schedule_golden_values():
    settings = TrainingSettings(steps=10, warmup_fraction=0.2)  # 2 warmup steps, then 8 of cosine
    values = [lr_factor(step, 10, settings) for step in range(10)]
    assert values[0] == pytest.approx(0.5) and values[1] == pytest.approx(1.0)
    assert values[2] == pytest.approx(1.0)
    assert values[6] == pytest.approx(0.5)  # halfway through the cosine
    assert values[9] == pytest.approx(0.5 * (1 + math.cos(math.pi * 7 / 8)))
    constant = TrainingSettings(steps=10, warmup_fraction=0.0, schedule="constant")
    assert [lr_factor(step, 10, constant) for step in range(10)] == [1.0] * 10


def test_settings_need_exactly_one_budget():
    assert TrainingSettings(epochs=5, num_examples=2000, batch_size=1).total_steps == 10_000
    assert TrainingSettings(epochs=2, num_examples=10, batch_size=4).total_steps == 6
    for bad in [{}, {"steps": 5, "epochs": 1, "num_examples": 3}, {"epochs": 2}]:
        with pytest.raises(ValueError, match="give either `steps`"):
            TrainingSettings(**bad)


def decoded_rows(batch, tokenizer):
    """(source, target) strings of each row of a seq2seq batch."""
    rows = []
    for ids, labels in zip(batch.input_ids.tolist(), batch.labels.tolist()):
        source = decode_ids(tokenizer, ids)
        target = decode_ids(tokenizer, [label for label in labels if label != IGNORE_INDEX])
        rows.append((source, target))
    return rows


def test_training_strings_stream_and_fixed_set(tokenizer, fmt):
    stream = letter_training_strings(
        ALPHABET, (2, 5), {"A": "B"}, tokenizer, fmt, TrainingSettings(steps=7, batch_size=16), seed=3
    )
    batches = list(stream)
    assert len(batches) == 7
    rows = [row for batch in batches for row in decoded_rows(batch, tokenizer)]
    assert all(2 <= len(source) <= 5 and not is_held_out(source) for source, _ in rows)
    assert all(target == source.replace("A", "B") for source, target in rows)
    again = list(
        letter_training_strings(
            ALPHABET, (2, 5), {"A": "B"}, tokenizer, fmt, TrainingSettings(steps=7, batch_size=16), seed=3
        )
    )
    assert all(
        torch.equal(a.input_ids, b.input_ids) and torch.equal(a.position_ids, b.position_ids)
        for a, b in zip(batches, again)
    )

    fixed = letter_training_strings(
        ALPHABET, (4, 4), {}, tokenizer, fmt, TrainingSettings(epochs=3, num_examples=10, batch_size=4), seed=0
    )
    batches = list(fixed)
    assert [batch.input_ids.shape[0] for batch in batches] == [4, 4, 2] * 3
    epochs = [sorted(row for batch in batches[i : i + 3] for row in decoded_rows(batch, tokenizer)) for i in (0, 3, 6)]
    assert epochs[0] == epochs[1] == epochs[2] and len(epochs[0]) == 10  # the same 10 strings, reshuffled


def test_training_lowers_the_loss(tokenizer, fmt):
    torch.manual_seed(0)
    model = build_model(TINY, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, seed=0)
    settings = TrainingSettings(steps=60, batch_size=32, lr=3e-3)
    log = train_model(
        model,
        letter_training_strings(ALPHABET, (1, 4), {}, tokenizer, fmt, settings, seed=1),
        settings,
        settings.total_steps,
        progress=False,
        log_every=10,
    )
    assert log.steps == 60 and not model.training
    first, last = log.losses[0][1], log.losses[-1][1]
    assert first > math.log(len(tokenizer)) - 1.0  # starts near uniform
    assert last < first - 0.5


def test_lora_training_changes_only_the_adapter(tokenizer, fmt):
    base = build_model(TINY, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, seed=0)
    before = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    lora = LoraSettings(rank=4, alpha=8, training=TrainingSettings(steps=5, batch_size=8, lr=1e-2))
    peft_model = get_peft_model(base, lora_config(lora, "llama"))
    adapters_before = {n: p.clone() for n, p in peft_model.named_parameters() if "lora_B" in n}
    train_model(
        peft_model,
        letter_training_strings(ALPHABET, (1, 4), {"A": "B"}, tokenizer, fmt, lora.training, seed=0),
        lora.training,
        lora.training.total_steps,
        progress=False,
    )
    after = peft_model.get_base_model().state_dict()
    for name, tensor in before.items():
        key = (
            name.replace(".weight", ".base_layer.weight")
            if name.replace(".weight", ".base_layer.weight") in after
            else name
        )
        torch.testing.assert_close(after[key], tensor, rtol=0, atol=0)
    assert any(not torch.equal(p, adapters_before[n]) for n, p in peft_model.named_parameters() if "lora_B" in n)


def test_training_refuses_a_frozen_model(tokenizer, fmt):
    model = build_model(TINY, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, seed=0)
    model.requires_grad_(False)
    settings = TrainingSettings(steps=1, batch_size=2)
    with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
        train_model(
            model,
            letter_training_strings(ALPHABET, (1, 2), {}, tokenizer, fmt, settings, seed=0),
            settings,
            settings.total_steps,
            progress=False,
        )
