"""Exact match: teacher-forced verdicts (golden), Wilson intervals, greedy decoding agreeing with them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mergecompose.composition import ComposedLM, compose_logprobs
from mergecompose.core.training import train_model
from mergecompose.experiments.compare_config import ModelSettings, TrainingSettings
from mergecompose.experiments.evaluate import (
    EvalSet,
    Scored,
    greedy_agreement,
    greedy_outputs,
    score,
    summary,
    teacher_forced_verdicts,
    wilson_interval,
)
from mergecompose.experiments.formats import IGNORE_INDEX, SequenceFormat
from mergecompose.experiments.models import build_model
from mergecompose.experiments.scored_systems import ComposedModel, SingleModel
from mergecompose.experiments.tokenizer import build_tokenizer
from mergecompose.studies.letters.letters_task_type import letter_training_strings

ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ "
X = IGNORE_INDEX


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: one torch thread is fastest, and much faster on a loaded machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def one_hot_logprobs(predictions: list[list[int]], vocab: int = 5) -> torch.Tensor:
    """(B, T, V) log-probs whose argmax at (b, t) is predictions[b][t]."""
    logits = torch.full((len(predictions), len(predictions[0]), vocab), -3.0)
    for b, row in enumerate(predictions):
        for t, token in enumerate(row):
            logits[b, t, token] = 2.0
    return torch.log_softmax(logits, dim=-1)


def test_teacher_forced_verdicts_golden():
    labels = torch.tensor([[X, X, 3, 4, 1], [X, 2, 2, 1, X], [X, X, 3, 4, 1]])
    predictions = [
        [0, 0, 3, 4, 1],
        [4, 2, 0, 0, 4],
        [4, 4, 3, 2, 1],
    ]  # right; wrong at 2nd and 3rd target; wrong at 2nd
    correct, first_error = teacher_forced_verdicts(one_hot_logprobs(predictions), labels)
    assert correct.tolist() == [True, False, False]
    assert first_error.tolist() == [-1, 1, 1]  # index among the labelled positions
    # Predictions at unlabelled positions never matter.
    correct, _ = teacher_forced_verdicts(one_hot_logprobs([[1, 1, 3, 4, 1]]), labels[:1])
    assert correct.tolist() == [True]


def test_wilson_interval_matches_the_formula():
    z = 1.959963984540054
    for k, n in [(8, 10), (0, 20), (1000, 1000), (37, 300)]:
        p = k / n
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        low, high = wilson_interval(k, n)
        assert low == pytest.approx(max(0.0, centre - half), abs=1e-12)
        assert high == pytest.approx(min(1.0, centre + half), abs=1e-12)
    assert wilson_interval(1000, 1000)[0] == pytest.approx(0.99617, abs=1e-5)  # 1,000 of 1,000: ≥ 99.6 %
    with pytest.raises(ValueError, match="`trials` must be >= 1"):
        wilson_interval(0, 0)


def test_summary_fields():
    record = summary(Scored(np.array([True, False, True, False]), np.array([-1, 3, -1, 0])))
    assert record["exact_match"] == 0.5 and record["n"] == 4
    assert record["ci95"][0] < 0.5 < record["ci95"][1]
    assert record["first_error"] == {"0": 1, "3": 1}


# ----------------------------------------------------------------------------- trained models


@pytest.fixture(scope="module")
def setup():
    """A tiny base trained to copy strings of length 1–5 (coupled positions), and a format."""
    tokenizer = build_tokenizer(ALPHABET)
    fmt = SequenceFormat(
        "seq2seq", "coupled", True, 48, tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.sep_token_id
    )
    model = build_model(ModelSettings(hidden_size=32, max_position_embeddings=48), len(tokenizer), 0, 1, seed=0)
    settings = TrainingSettings(steps=150, batch_size=32, lr=5e-3)
    train_model(
        model,
        letter_training_strings(ALPHABET, (1, 5), {}, tokenizer, fmt, settings, seed=0),
        settings,
        settings.total_steps,
        progress=False,
    )
    return tokenizer, fmt, model


def copy_set(length: int, count: int, seed: int, replace: dict | None = None) -> EvalSet:
    """Random strings; targets are the strings with `replace` applied (default: copies)."""
    rng = np.random.default_rng(seed)
    texts = ["".join(rng.choice(list(ALPHABET), size=length)) for _ in range(count)]
    targets = ["".join((replace or {}).get(c, c) for c in text) for text in texts]
    return EvalSet(f"copy@{length}", length, tuple(texts), tuple(targets))


def test_greedy_decoding_agrees_with_teacher_forcing(setup):
    """The teacher-forced verdict is the greedy one, example by example, right or wrong.

    The base copies; scored against A → B, exactly the strings without an A are right, and the
    first error is at the first A."""
    tokenizer, fmt, model = setup
    system = SingleModel(model)
    for length in [3, 5, 9, 14]:
        eval_set = copy_set(length, 24, seed=length, replace={"A": "B", "E": "F", "I": "J"})
        scored = score(system, eval_set, fmt, tokenizer, batch_size=10)
        outputs = greedy_outputs(system, eval_set, fmt, tokenizer, batch_size=10)
        greedy = np.array([output == target for output, target in zip(outputs, eval_set.targets)])
        np.testing.assert_array_equal(greedy, scored.correct)
        np.testing.assert_array_equal(scored.correct, [not set("AEI") & set(text) for text in eval_set.sources])
        first = [min((text.index(c) for c in "AEI" if c in text), default=-1) for text in eval_set.sources]
        np.testing.assert_array_equal(scored.first_error, first)
        assert outputs == list(eval_set.sources)  # greedy decoding copies, up to <eos>
        assert 0 < scored.correct.sum() < 24
        assert greedy_agreement(system, eval_set, fmt, tokenizer, 10, scored)["agree"] == 24


def test_composed_system_uses_the_given_positions(setup):
    """ComposedLM with explicit position ids equals the rule applied to each model's own logits."""
    tokenizer, fmt, model = setup
    other = build_model(ModelSettings(hidden_size=32, max_position_embeddings=48), len(tokenizer), 0, 1, seed=5)
    batch = fmt.batch([[3, 4, 5], [6]], [[3, 4, 5], [6]])
    composed = ComposedModel(ComposedLM(model, [other, model]))
    logits = [
        m(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
        for m in (model, other, model)
    ]
    expected = compose_logprobs(logits[0], logits[1:])
    torch.testing.assert_close(composed.logprobs(batch), expected)
    contiguous = ComposedLM(model, [other, model]).logprobs(batch.input_ids, batch.attention_mask)
    assert not torch.allclose(contiguous, expected)  # the default positions differ from the coupled ones
    eval_set = copy_set(4, 8, seed=1)
    scored = score(composed, eval_set, fmt, tokenizer, 8)
    assert greedy_agreement(composed, eval_set, fmt, tokenizer, 8, scored)["agree"] == 8


@pytest.mark.parametrize("implementation", ["stacked", "peft"])
def test_gpt2_lora_experts_compose_on_one_base(tmp_path, implementation):
    """GPT-2's Conv1D LoRA adapters (the paper-shaped models) on one shared base equal merged copies."""
    from peft import PeftModel, get_peft_model

    from mergecompose.experiments.compare_config import LoraSettings
    from mergecompose.experiments.models import lora_config

    tokenizer = build_tokenizer(ALPHABET)
    settings = ModelSettings(architecture="gpt2", hidden_size=32, max_position_embeddings=16)

    def base():
        return build_model(settings, len(tokenizer), 0, 1, seed=0).eval()

    folders = {}
    for index, name in enumerate(["ab", "cd"]):
        torch.manual_seed(10 + index)
        config = lora_config(LoraSettings(rank=4, alpha=8, training=TrainingSettings(steps=1)), "gpt2")
        config.init_lora_weights = False  # random A and B, so that each adapter changes the model
        get_peft_model(base(), config).save_pretrained(str(tmp_path / name))
        folders[name] = str(tmp_path / name)
    composed = ComposedLM.from_adapters(base(), folders, lora_implementation=implementation)
    merged = [PeftModel.from_pretrained(base(), folders[name]).merge_and_unload().eval() for name in ["ab", "cd"]]
    ids = torch.tensor([[5, 6, 7, 8, 9], [9, 3, 3, 4, 10]])
    expected = compose_logprobs(*[m(input_ids=ids).logits for m in [base()]], [m(input_ids=ids).logits for m in merged])
    torch.testing.assert_close(composed.logprobs(ids), expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(merged[0](input_ids=ids).logits, base()(input_ids=ids).logits)
