"""How a verdict rule does on real settings, against the best constant answer.

A real setting (real LoRA experts, `mergecompose real-sweep`) carries its paired label
(`mergecompose.analysis.paired_outcome`: one of `OUTCOMES`, "merge", "compose", "either", "neither") and the
unlabelled diagnostics `overlap --recommend` measures. `score_on_real_settings` applies a `VerdictRule` to each
and counts how often its verdict is the label; `RealSettingsScore` is the result, kept in a rule file as
`VerdictRule.real_settings` and printed by `overlap --recommend` beside the verdict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from scipy.stats import binomtest

from mergecompose.analysis.paired_outcome import OUTCOMES

if TYPE_CHECKING:  # for the annotation only: predict.py imports RealSettingsScore for `VerdictRule.real_settings`
    from mergecompose.analysis.predict import VerdictRule

PairedLabel = Literal["merge", "compose", "either", "neither"]
# A rule's verdict (`mergecompose.analysis.predict.VERDICTS`) as a paired label: a composition with a remedy is a
# composition. "undecided" has none, and counts as wrong.
VERDICT_LABELS = {
    "either": "either",
    "compose": "compose",
    "merge": "merge",
    "compose+gate": "compose",
    "neither": "neither",
}


def wilson_interval(correct: int, n: int) -> tuple[float, float]:
    """The 95 % Wilson score interval of `correct` / `n` (scipy's `binomtest(correct, n).proportion_ci`)."""
    interval = binomtest(correct, n).proportion_ci(confidence_level=0.95, method="wilson")
    return float(interval.low), float(interval.high)


class ConstantScore(BaseModel):
    """Always answering `label`: right on the settings that carry it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    label: PairedLabel
    accuracy: float = Field(ge=0, le=1)
    interval: tuple[float, float]


class RealSettingsScore(BaseModel):
    """A verdict rule's accuracy on n real settings, with the best constant answer and the labels' base rates.

    `accuracy` = `correct` / `n` with its 95 % Wilson `interval`; `best_constant` the label most settings carry
    (ties: the first in `OUTCOMES`), whose accuracy is its count / n; `base_rates[label]` = `counts[label]` / n;
    `undecided`: how many settings got the rule's "undecided" (each counted wrong); `source`: the records file
    and its version.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    n: int = Field(ge=1)
    correct: int = Field(ge=0)
    accuracy: float = Field(ge=0, le=1)
    interval: tuple[float, float]
    best_constant: ConstantScore
    base_rates: dict[PairedLabel, float]
    counts: dict[PairedLabel, int]
    undecided: int = Field(ge=0)
    source: str = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> RealSettingsScore:
        if set(self.counts) != set(OUTCOMES) or set(self.base_rates) != set(OUTCOMES):
            raise ValueError(
                f"`counts` and `base_rates` each need one entry per label {OUTCOMES}, "
                f"got {sorted(self.counts)} and {sorted(self.base_rates)}"
            )
        if sum(self.counts.values()) != self.n:
            raise ValueError(f"`counts` must sum to `n` = {self.n}, got {sum(self.counts.values())}")
        if self.correct + self.undecided > self.n:
            raise ValueError(
                f"`correct` + `undecided` must be at most `n` = {self.n} (undecided counts wrong), "
                f"got {self.correct} + {self.undecided}"
            )
        return self

    def beats_best_constant(self) -> bool:
        """Whether the rule is right more often than always answering the best constant (strictly)."""
        return self.correct > self.counts[self.best_constant.label]


def score_on_real_settings(
    rule: VerdictRule, settings: Sequence[tuple[str, Mapping[str, float | None]]], source: str
) -> RealSettingsScore:
    """`rule`'s accuracy on real settings, each `(paired label, diagnostics)`, against the best constant.

    The rule's verdict (`rule.verdict(diagnostics)`) is right where its paired label (`VERDICT_LABELS`:
    "compose+gate" is "compose", the others are themselves) is the setting's label; "undecided" is wrong.
    With n settings, c of them right and `count[l]` carrying label l:

        accuracy = c / n, with the 95 % Wilson interval of c out of n;
        best constant = argmax_l count[l] (ties: the first in `OUTCOMES`), accuracy count[l] / n;
        base rate of l = count[l] / n.

    The shipped rule (`predict_rule.json`) was fitted on synthetic settings only, so every real setting is held
    out from it; a rule fitted on real settings would need them held out before this score means the same.
    `source` names the records the settings came from and their version.
    """
    if not settings:
        raise ValueError("`settings` must hold at least one (paired label, diagnostics) pair, got none")
    counts = dict.fromkeys(OUTCOMES, 0)
    correct = undecided = 0
    for index, (label, diagnostics) in enumerate(settings):
        if label not in counts:
            raise ValueError(f"`settings[{index}]` has label {label!r}; the paired labels are {OUTCOMES}")
        counts[label] += 1
        verdict = rule.verdict(diagnostics)
        undecided += verdict not in VERDICT_LABELS
        correct += VERDICT_LABELS.get(verdict) == label
    n = len(settings)
    best = max(OUTCOMES, key=lambda label: (counts[label], -OUTCOMES.index(label)))
    return RealSettingsScore(
        n=n,
        correct=correct,
        accuracy=correct / n,
        interval=wilson_interval(correct, n),
        best_constant=ConstantScore(label=best, accuracy=counts[best] / n, interval=wilson_interval(counts[best], n)),
        base_rates={label: count / n for label, count in counts.items()},
        counts=counts,
        undecided=undecided,
        source=source,
    )
