"""From (source, target) token ids to model inputs: the two formulations and their position ids.

**aligned** (the paper's notebook): the model reads `x_1 … x_L` and the logit at position t is
scored against `f(x_t)`, unshifted (causal tagging).

**seq2seq**: the prompt is `x_1 … x_L <eos> <sep>` (the input, its terminator, the separator);
the model then generates `y_1 … y_L <eos>`. For training and teacher-forced scoring the sequence
is `x_1 … x_L <eos> <sep> y_1 … y_L`, and the logit at `<sep>` is scored against `y_1`, at `y_k`
against `y_{k+1}`, at `y_L` against `<eos>` (labels are already shifted: the logit at t is
scored against `labels[:, t]`).

Position ids come from L+1 *slots* `s_0 < s_1 < … < s_L`:

* `coupled` (position coupling, Cho et al. 2024): `x_i` sits at `s_{i-1}`, the terminator at
  `s_L`, `<sep>` at `s_0`, and `y_k` at `s_k`. So the token that must predict `y_{k+1}` sits at
  the same position as `x_{k+1}` (and `y_L`, which must predict `<eos>`, at the terminator's):
  the copy is a zero-offset lookup at every length. Generation continues one position per token,
  which is what `ComposedLM.generate` does by default.
* `contiguous`: one slot per token, in order (2L+2 slots); the usual scheme.

At evaluation the slots are `0, 1, 2, …`. In training, with `randomize` (Ruoss et al., 2023),
they are a sorted random subset of `[0, span)`, with `span` uniform in `[n_slots, max_position]`:
relative distances up to `max_position` are seen on short strings, so longer strings at
evaluation bring no unseen distance.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

# IGNORE_INDEX and Batch are part of this module's surface: the batches it makes.
from mergecompose.core.training import IGNORE_INDEX, Batch  # noqa: F401

Formulation = Literal["aligned", "seq2seq"]
PositionScheme = Literal["coupled", "contiguous"]


@dataclass
class Prompt:
    """Left-padded generation prompts `(batch, prompt)` and the positions of generated tokens `(batch, new)`."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    generated_position_ids: torch.Tensor


def slot_positions(n_slots: int, rng: random.Random | None = None, max_position: int | None = None) -> list[int]:
    """`[0, …, n−1]`, or with `rng` a sorted random subset of `[0, span)`, span ~ U{n_slots, …, max_position}."""
    if rng is None:
        return list(range(n_slots))
    if max_position is None or max_position < n_slots:
        raise ValueError(
            f"`max_position` must be >= the number of slots ({n_slots}) to draw random positions, got {max_position}"
        )
    span = rng.randint(n_slots, max_position)
    return sorted(rng.sample(range(span), n_slots))


class SequenceFormat:
    """Turns token ids into `Batch`es (training, teacher-forced scoring) and `Prompt`s (generation).

    Args:
        formulation: "aligned" or "seq2seq".
        positions: "coupled" or "contiguous" (seq2seq; aligned is always one slot per token).
        randomize: draw random slot positions for training examples.
        max_position: the largest position id + 1 that training may draw (randomize) and that
            evaluation may reach; at most the model's `max_position_embeddings`.
        pad_id, eos_id, sep_id: the tokenizer's special ids.
    """

    def __init__(
        self,
        formulation: Formulation,
        positions: PositionScheme,
        randomize: bool,
        max_position: int,
        pad_id: int,
        eos_id: int,
        sep_id: int,
    ):
        if formulation not in ("aligned", "seq2seq"):
            raise ValueError(f"`formulation` must be 'aligned' or 'seq2seq', got {formulation!r}")
        if positions not in ("coupled", "contiguous"):
            raise ValueError(f"`positions` must be 'coupled' or 'contiguous', got {positions!r}")
        self.formulation = formulation
        self.positions = positions
        self.randomize = randomize
        self.max_position = max_position
        self.pad_id, self.eos_id, self.sep_id = pad_id, eos_id, sep_id

    # ------------------------------------------------------------------ one example

    def n_slots(self, length: int, target_length: int | None = None) -> int:
        """How many distinct positions an example with `length` source characters uses.

        `target_length` (default `length`) matters only for contiguous seq2seq, the one
        layout where a target may be longer or shorter than its source."""
        if self.formulation == "aligned":
            return length
        if self.positions == "coupled":
            return length + 1
        return length + 2 + (length if target_length is None else target_length)

    def example(self, source: Sequence[int], target: Sequence[int], rng: random.Random | None = None):
        """(ids, positions, labels) lists of one training (`rng` given) or scoring example."""
        length = len(source)
        if len(target) != length and (self.formulation == "aligned" or self.positions == "coupled"):
            raise ValueError(
                f"the {self.formulation} / {self.positions} format needs a target as long as its source, "
                f"got {len(target)} and {length} tokens"
            )
        slots = self._slots(length, rng, len(target))
        if self.formulation == "aligned":
            return list(source), slots, list(target)
        ids = [*source, self.eos_id, self.sep_id, *target]
        labels = [IGNORE_INDEX] * (length + 1) + [*target, self.eos_id]
        if self.positions == "coupled":
            positions = [*slots, slots[0], *slots[1:]]
        else:
            positions = slots[: len(ids)]
        return ids, positions, labels

    def _slots(self, length: int, rng: random.Random | None, target_length: int | None = None) -> list[int]:
        n_slots = self.n_slots(length, target_length)
        if n_slots > self.max_position:
            raise ValueError(
                f"a string of length {length} (target {target_length if target_length is not None else length}) needs "
                f"{n_slots} positions, more than `max_position` = {self.max_position}"
            )
        if rng is not None and self.randomize:
            return slot_positions(n_slots, rng, self.max_position)
        return slot_positions(n_slots)

    # ------------------------------------------------------------------ batches

    def batch(
        self, sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], rng: random.Random | None = None
    ) -> Batch:
        """Right-padded `Batch` of training (`rng` given) or scoring (`rng` None) examples."""
        rows = [self.example(source, target, rng) for source, target in zip(sources, targets, strict=True)]
        width = max(len(ids) for ids, _, _ in rows)
        shape = (len(rows), width)
        input_ids = torch.full(shape, self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros(shape, dtype=torch.long)
        position_ids = torch.zeros(shape, dtype=torch.long)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
        for row, (ids, positions, row_labels) in enumerate(rows):
            n = len(ids)
            input_ids[row, :n] = torch.tensor(ids)
            attention_mask[row, :n] = 1
            position_ids[row, :n] = torch.tensor(positions)
            labels[row, :n] = torch.tensor(row_labels)
        return Batch(input_ids, attention_mask, position_ids, labels)

    def prompt(self, sources: Sequence[Sequence[int]], max_new_tokens: int) -> Prompt:
        """Left-padded seq2seq prompts `x … <eos> <sep>` at evaluation positions, for `generate`."""
        if self.formulation != "seq2seq":
            raise ValueError(f"only the seq2seq formulation generates; this format is {self.formulation!r}")
        width = max(len(source) for source in sources) + 2
        shape = (len(sources), width)
        input_ids = torch.full(shape, self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros(shape, dtype=torch.long)
        position_ids = torch.zeros(shape, dtype=torch.long)
        generated = torch.zeros((len(sources), max_new_tokens), dtype=torch.long)
        for row, source in enumerate(sources):
            length = len(source)
            slots = slot_positions(self.n_slots(length))
            if self.positions == "coupled":
                prompt_positions = [*slots, slots[0]]
                first_generated = slots[0] + 1  # y_k at s_k, and evaluation slots are 0, 1, 2, ...
            else:
                prompt_positions = slots[: length + 2]
                first_generated = length + 2
            ids = [*source, self.eos_id, self.sep_id]
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1
            position_ids[row, width - len(ids) :] = torch.tensor(prompt_positions)
            generated[row] = first_generated + torch.arange(max_new_tokens)
        return Prompt(input_ids, attention_mask, position_ids, generated)
