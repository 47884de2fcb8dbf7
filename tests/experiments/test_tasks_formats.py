"""Model inputs of both formulations: golden layouts, position coupling, prompts vs training."""

from __future__ import annotations

import random

import pytest
import torch

from mergecompose.experiments.formats import IGNORE_INDEX, SequenceFormat, slot_positions

PAD, EOS, SEP = 0, 1, 2
X = IGNORE_INDEX


def seq2seq(positions="coupled", randomize=True, max_position=64):
    return SequenceFormat("seq2seq", positions, randomize, max_position, PAD, EOS, SEP)


def test_coupled_seq2seq_golden():
    ids, positions, labels = seq2seq().example([10, 11, 12], [20, 11, 22])
    assert ids == [10, 11, 12, EOS, SEP, 20, 11, 22]
    assert positions == [0, 1, 2, 3, 0, 1, 2, 3]
    assert labels == [X, X, X, X, 20, 11, 22, EOS]


def test_contiguous_seq2seq_golden():
    ids, positions, labels = seq2seq("contiguous").example([10, 11], [20, 11])
    assert ids == [10, 11, EOS, SEP, 20, 11]
    assert positions == [0, 1, 2, 3, 4, 5]
    assert labels == [X, X, X, 20, 11, EOS]


def test_aligned_golden():
    fmt = SequenceFormat("aligned", "contiguous", False, 16, PAD, EOS, SEP)
    assert fmt.example([10, 11, 12], [20, 11, 22]) == ([10, 11, 12], [0, 1, 2], [20, 11, 22])


def test_random_slots_are_sorted_distinct_and_in_range():
    rng = random.Random(0)
    spans = []
    for _ in range(300):
        slots = slot_positions(9, rng, 40)
        assert slots == sorted(set(slots)) and len(slots) == 9
        assert 0 <= slots[0] and slots[-1] < 40
        spans.append(slots[-1])
    assert min(spans) < 15 and max(spans) > 35  # dense and sparse draws both occur
    with pytest.raises(ValueError, match="`max_position` must be >= the number of slots"):
        slot_positions(9, rng, 8)


def test_coupling_holds_under_random_positions():
    """The token that predicts y_{k+1} shares its position with x_{k+1}; the last one with the terminator."""
    rng = random.Random(1)
    fmt = seq2seq(max_position=200)
    for length in [1, 5, 16]:
        source = list(range(3, 3 + length))
        ids, positions, labels = fmt.example(source, source, rng)
        x_positions = positions[: length + 1]  # x_1 … x_L and the terminator
        assert x_positions == sorted(set(x_positions))
        predictors = [index for index, label in enumerate(labels) if label != X]  # <sep>, y_1 … y_L
        assert [positions[index] for index in predictors] == x_positions
        assert [labels[index] for index in predictors] == [*source, EOS]


def test_batch_right_pads_and_labels_padding_ignored():
    batch = seq2seq().batch([[10, 11, 12], [13]], [[10, 11, 12], [13]])
    assert batch.input_ids.tolist() == [[10, 11, 12, EOS, SEP, 10, 11, 12], [13, EOS, SEP, 13, PAD, PAD, PAD, PAD]]
    assert batch.attention_mask.tolist() == [[1] * 8, [1, 1, 1, 1, 0, 0, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 0, 1, 0, 0, 0, 0]]
    assert batch.labels.tolist() == [[X, X, X, X, 10, 11, 12, EOS], [X, X, 13, EOS, X, X, X, X]]


@pytest.mark.parametrize("scheme", ["coupled", "contiguous"])
def test_prompt_and_generated_positions_match_teacher_forcing(scheme):
    """Generation sees each token at the position it had in training and scoring (no drift)."""
    fmt = seq2seq(scheme, randomize=False)
    sources = [[10, 11, 12, 13], [14, 15]]
    prompt = fmt.prompt(sources, max_new_tokens=6)
    for row, source in enumerate(sources):
        ids, positions, _ = fmt.example(source, source)
        mask = prompt.attention_mask[row].bool()
        assert prompt.input_ids[row][mask].tolist() == ids[: len(source) + 2]
        generated = prompt.generated_position_ids[row].tolist()
        assert prompt.position_ids[row][mask].tolist() + generated[: len(source)] == positions
        # transformers' generate continues the prompt's last position by one per token.
        assert generated == list(
            range(prompt.position_ids[row, -1].item() + 1, prompt.position_ids[row, -1].item() + 7)
        )
    assert prompt.attention_mask.tolist() == [[1] * 6, [0, 0, 1, 1, 1, 1]]


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="needs a target as long as its source"):
        seq2seq().example([10, 11], [10])
    with pytest.raises(ValueError, match="more than `max_position` = 4"):
        seq2seq(max_position=4).example([10, 11, 12, 13], [10, 11, 12, 13])
    with pytest.raises(ValueError, match="`formulation` must be"):
        SequenceFormat("tagging", "coupled", True, 8, PAD, EOS, SEP)
    with pytest.raises(ValueError, match="only the seq2seq formulation generates"):
        SequenceFormat("aligned", "contiguous", False, 8, PAD, EOS, SEP).prompt([[3]], 2)
    batch = seq2seq().batch([[10]], [[10]])
    assert batch.to("cpu").input_ids.dtype == torch.long
