"""One outcome label for every setting, synthetic or real: the best merge against the best composition, same items.

Both systems answer the same n test items; an item is right or wrong for each. Only the discordant items tell
them apart: `merge_only` (the merge right, the composition wrong) and `compose_only` (the other way). The exact
McNemar test asks whether `compose_only` among the d = merge_only + compose_only discordant items is what a fair
coin gives: its two-sided p-value is scipy's `binomtest(compose_only, d, 0.5)` (1 where d = 0). At level α:

* "merge" where p < α and merge_only > compose_only;
* "compose" where p < α and compose_only > merge_only;
* "either" otherwise: no significant difference at this n.

The label is defined before any setting is evaluated, and the same for every setting: which merge and which
composition are "best" is chosen on validation items disjoint from the test items, never on these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from scipy.stats import binomtest

ALPHA = 0.05
OUTCOMES = ("merge", "compose", "either")


@dataclass(frozen=True)
class PairedOutcome:
    """The label and the counts it came from."""

    label: str
    items: int
    merge_right: int
    compose_right: int
    merge_only: int
    compose_only: int
    p_value: float
    alpha: float

    def to_dict(self) -> dict:
        return asdict(self)


def _rights(name: str, values: Sequence[bool]) -> list[bool]:
    if isinstance(values, (str, bytes)) or not all(isinstance(value, bool) for value in values):
        raise ValueError(f"`{name}` must be a sequence of bools, one per item, got {values!r:.80}")
    return list(values)


def paired_outcome(merge_right: Sequence[bool], compose_right: Sequence[bool], alpha: float = ALPHA) -> PairedOutcome:
    """The label of a setting from its best merge's and best composition's right/wrong on the same items, in order."""
    merge, compose = _rights("merge_right", merge_right), _rights("compose_right", compose_right)
    if len(merge) != len(compose) or not merge:
        raise ValueError(
            f"`merge_right` and `compose_right` must score the same items, at least one, got {len(merge)} and "
            f"{len(compose)}"
        )
    if not 0 < alpha < 1:
        raise ValueError(f"`alpha` must be in (0, 1), got {alpha!r}")
    merge_only = sum(m and not c for m, c in zip(merge, compose))
    compose_only = sum(c and not m for m, c in zip(merge, compose))
    discordant = merge_only + compose_only
    p_value = float(binomtest(compose_only, discordant, 0.5).pvalue) if discordant else 1.0
    label = "either"
    if p_value < alpha:
        label = "merge" if merge_only > compose_only else "compose"
    return PairedOutcome(label, len(merge), sum(merge), sum(compose), merge_only, compose_only, p_value, alpha)
