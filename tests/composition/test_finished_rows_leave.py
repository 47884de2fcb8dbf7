"""Finished rows leave the decoding pass (composition/sampling.py): each row still decodes what it decodes alone.

EOS is a set of ids common under these random models, so the rows of one batch finish many steps
apart; the batch is compacted (`Backend.keep_rows` is called) and every row's tokens equal those of
the row decoded alone, for full experts (one cache per model) and LoRA experts (one shared cache).
"""

from __future__ import annotations

import copy

import pytest
import torch

from mergecompose.composition import ComposedLM
from mergecompose.core.tiny import left_padded_batch

EOS = [7, 19, 33, 41, 50]
PAD = 0


def composition(kind, base_model, expert_models, lora_dirs):
    if kind == "full":
        return ComposedLM(base_model, expert_models, weights=[0.5, 0.5])
    return ComposedLM.from_adapters(copy.deepcopy(base_model), lora_dirs, weights=[0.5, 0.5])


def count_calls(monkeypatch, backend):
    calls = []
    keep_rows = backend.keep_rows

    def counted(caches, rows, batch):
        calls.append((rows.tolist(), batch))
        return keep_rows(caches, rows, batch)

    monkeypatch.setattr(backend, "keep_rows", counted)
    return calls


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_each_row_decodes_what_it_decodes_alone(kind, base_model, expert_models, lora_dirs, monkeypatch):
    composed = composition(kind, base_model, expert_models, lora_dirs)
    ids, mask = left_padded_batch([5, 7, 3, 6, 4, 8], seed=4)
    options = dict(max_new_tokens=24, eos_token_id=EOS, pad_token_id=PAD)
    calls = count_calls(monkeypatch, composed.backend)
    batched = composed.generate(ids, mask, **options)
    assert calls, "no row left the pass: the test does not exercise compaction"
    lengths = (batched[:, ids.shape[1] :] != PAD).sum(1)
    assert lengths.min() < lengths.max()  # the rows finished apart
    for row in range(ids.shape[0]):
        width = int(mask[row].sum())
        alone = composed.generate(ids[row : row + 1, -width:], mask[row : row + 1, -width:], **options)
        made = alone.shape[1] - width
        assert torch.equal(batched[row, ids.shape[1] : ids.shape[1] + made], alone[0, width:]), row
        assert (batched[row, ids.shape[1] + made :] == PAD).all()


def test_sampled_rows_that_left_stay_finished(base_model, expert_models, lora_dirs, monkeypatch):
    composed = composition("lora", base_model, expert_models, lora_dirs)
    ids, mask = left_padded_batch([5, 7, 3, 6, 4, 8], seed=5)
    calls = count_calls(monkeypatch, composed.backend)
    out = composed.generate(ids, mask, max_new_tokens=24, eos_token_id=EOS, pad_token_id=PAD, do_sample=True, seed=2)
    assert calls
    again = composed.generate(ids, mask, max_new_tokens=24, eos_token_id=EOS, pad_token_id=PAD, do_sample=True, seed=2)
    assert torch.equal(out, again)  # a seed still repeats its draws
    for row in out[:, ids.shape[1] :]:
        ended = torch.isin(row, torch.tensor(EOS)).nonzero()
        if len(ended):  # after its EOS a row holds only padding
            assert (row[int(ended[0]) + 1 :] == PAD).all()
