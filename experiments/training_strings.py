"""Strings for every task type: the held-out rule, one rejection sampler, one training-batch stream.

Training draws only strings that are not held out and evaluation only those that are, so no
evaluation string is ever trained on, and the training data does not depend on the
evaluation's sizes or seeds.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Iterator, Sequence

from mergecompose.experiments.formats import Batch, SequenceFormat
from mergecompose.experiments.tokenizer import encode_strings

HELD_OUT_MODULUS = 8


def is_held_out(text: str) -> bool:
    """Whether `text` is reserved for evaluation: CRC-32 of its UTF-8 bytes ≡ 0 (mod 8)."""
    return zlib.crc32(text.encode()) % HELD_OUT_MODULUS == 0


def distinct_strings(
    draw: Callable[[], Sequence[str]],
    count: int,
    keep: Callable[[str], bool],
    exclude: set[str] | frozenset[str],
    what: str,
    max_draws: int,
) -> list[str]:
    """`count` distinct strings from repeated `draw()` calls (each gives a chunk) that pass `keep`.

    Rejection sampling in draw order (seeded by whatever `draw` uses), skipping `exclude`; stops
    as soon as `count` are found. Raises a ValueError naming `what` when fewer than `count` turn
    up in `max_draws` drawn strings.
    """
    if count < 0:
        raise ValueError(f"`count` must be >= 0, got {count}")
    found: dict[str, None] = {}  # insertion-ordered set: the order is the draw order
    draws = 0
    while len(found) < count:
        if draws >= max_draws:
            raise ValueError(f"found only {len(found)} of {count} distinct strings for {what} in {draws} draws")
        chunk = draw()
        draws += len(chunk)
        for text in chunk:
            if text not in found and text not in exclude and keep(text):
                found[text] = None
                if len(found) == count:
                    break
    return list(found)


class TrainingStrings:
    """Training batches of (input, target) pairs; held-out strings never appear.

    `sample(rng)` draws one input, `transform(text)` gives its target. With `settings.steps`:
    fresh inputs every step. With `settings.epochs` and `settings.num_examples`: one fixed set,
    reshuffled every epoch (the paper's recipe). Seeded: the same seed gives the same batches.
    """

    def __init__(
        self,
        sample: Callable[[random.Random], str],
        transform: Callable[[str], str],
        tokenizer,
        sequence_format: SequenceFormat,
        settings,
        seed: int,
    ):
        self.sample = sample
        self.transform = transform
        self.tokenizer = tokenizer
        self.format = sequence_format
        self.settings = settings
        self.rng = random.Random(seed)

    def _draw(self) -> str:
        while True:
            text = self.sample(self.rng)
            if not is_held_out(text):
                return text

    def _batch(self, texts: list[str]) -> Batch:
        sources = encode_strings(self.tokenizer, texts)
        targets = encode_strings(self.tokenizer, [self.transform(text) for text in texts])
        return self.format.batch(sources, targets, rng=self.rng)

    def __iter__(self) -> Iterator[Batch]:
        size = self.settings.batch_size
        if self.settings.steps is not None:
            for _ in range(self.settings.steps):
                yield self._batch([self._draw() for _ in range(size)])
            return
        fixed = [self._draw() for _ in range(self.settings.num_examples)]
        for _ in range(self.settings.epochs):
            order = list(range(len(fixed)))
            self.rng.shuffle(order)
            for start in range(0, len(order), size):
                yield self._batch([fixed[index] for index in order[start : start + size]])
