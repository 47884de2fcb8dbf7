"""One outcome label for every setting, synthetic or real: the best merge against the best composition, same items.

Both systems answer the same n test items; an item is right or wrong for each. Only the discordant items tell
them apart: `merge_only` (the merge right, the composition wrong) and `compose_only` (the other way). The exact
McNemar test asks whether `compose_only` among the d = merge_only + compose_only discordant items is what a fair
coin gives: its two-sided p-value is scipy's `binomtest(compose_only, d, 0.5)` (1 where d = 0). At level α:

* "neither" where neither system reaches the floor (`FLOOR`, 10 % of the items right: the scorer's lenient
  score): both fail, whatever the test says;
* "merge" where p < α and merge_only > compose_only;
* "compose" where p < α and compose_only > merge_only;
* "either" otherwise: no significant difference at this n, and at least one system reaches the floor (almost
  always both: a system below the floor against one above it that the test cannot tell apart is a handful of
  items, and is labelled "either" too, as no side is shown better).

The label is defined before any setting is evaluated, and the same for every setting: which merge and which
composition are "best" is chosen on validation items disjoint from the test items, never on these. The floor was
fixed at 10 % before the records it labels were measured (`docs/guides/merge-or-compose.md`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from scipy.stats import binomtest

ALPHA = 0.05
# The share of items right below which a system "does not work": neither side reaching it labels "neither".
FLOOR = 0.10
OUTCOMES = ("merge", "compose", "either", "neither")


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
    floor: float = FLOOR

    def to_dict(self) -> dict:
        return asdict(self)


def _rights(name: str, values: Sequence[bool]) -> list[bool]:
    if isinstance(values, (str, bytes)) or not all(isinstance(value, bool) for value in values):
        raise ValueError(f"`{name}` must be a sequence of bools, one per item, got {values!r:.80}")
    return list(values)


def paired_outcome(
    merge_right: Sequence[bool], compose_right: Sequence[bool], alpha: float = ALPHA, floor: float = FLOOR
) -> PairedOutcome:
    """The label of a setting from its best merge's and best composition's right/wrong on the same items, in order."""
    merge, compose = _rights("merge_right", merge_right), _rights("compose_right", compose_right)
    if len(merge) != len(compose) or not merge:
        raise ValueError(
            f"`merge_right` and `compose_right` must score the same items, at least one, got {len(merge)} and "
            f"{len(compose)}"
        )
    if not 0 < alpha < 1:
        raise ValueError(f"`alpha` must be in (0, 1), got {alpha!r}")
    if not 0 <= floor <= 1:
        raise ValueError(f"`floor` must be in [0, 1], got {floor!r}")
    merge_only = sum(m and not c for m, c in zip(merge, compose))
    compose_only = sum(c and not m for m, c in zip(merge, compose))
    discordant = merge_only + compose_only
    p_value = float(binomtest(compose_only, discordant, 0.5).pvalue) if discordant else 1.0
    n = len(merge)
    label = "either"
    if sum(merge) / n < floor and sum(compose) / n < floor:  # a share, as the floor is stated
        label = "neither"
    elif p_value < alpha:
        label = "merge" if merge_only > compose_only else "compose"
    return PairedOutcome(label, n, sum(merge), sum(compose), merge_only, compose_only, p_value, alpha, floor)
