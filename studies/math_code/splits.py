"""The three splits every generator of this package takes, and the checks of its arguments."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

Item = TypeVar("Item")
Template = TypeVar("Template")
RETIRE_AFTER = 200  # a template that draws this many repeats in a row has no new problems left

SPLITS = ("train", "validation", "test")  # disjoint template sets: train the experts, choose merges, report
# The study's held-out sizes per kind and split (train is sized by the training run).
SPLIT_SIZES = {
    "math": {"validation": 100, "test": 200},
    "code": {"validation": 100, "test": 150},
    "mixed": {"validation": 100, "test": 150},
}


def check_split(split: object) -> str:
    if split not in SPLITS:
        raise ValueError(f"`split` must be one of {', '.join(SPLITS)}, got {split!r}")
    return str(split)


def check_count(count: object) -> int:
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"`count` must be an integer >= 1, got {count!r}")
    return count


def distinct_draws(
    templates: Sequence[Template], count: int, draw: Callable[[Template], Item], key: Callable[[Item], Hashable]
) -> list[Item]:
    """`count` items with distinct keys, drawn from the templates in turn; a template out of new ones retires.

    Raises if all templates retire first, naming how many distinct items there were.
    """
    items: list[Item] = []
    seen: set[Hashable] = set()
    repeats = dict.fromkeys(range(len(templates)), 0)
    while len(items) < count and repeats:
        for index in list(repeats):
            if len(items) == count:
                break
            item = draw(templates[index])
            if key(item) in seen:
                repeats[index] += 1
                if repeats[index] >= RETIRE_AFTER:
                    del repeats[index]
                continue
            repeats[index] = 0
            seen.add(key(item))
            items.append(item)
    if len(items) < count:
        raise ValueError(f"`count` must be at most the {len(items)} distinct problems of these templates, got {count}")
    return items
