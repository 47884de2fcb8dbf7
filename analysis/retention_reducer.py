"""`RetentionReducer`: which of the merge and the composition keeps each expert's decisions, over a stream of
measured positions (`mergecompose.analysis.retention` has the formulas)."""

from __future__ import annotations

import math

import torch

from mergecompose.analysis import retention as rx
from mergecompose.analysis.measured_batch import MeasuredBatch

SYSTEMS = ("merge", "compose")


class RetentionReducer:
    """Per expert: the retention KL and kept share in the merge and in the composition, and the base's mean
    log-probability of the expert's top-1 token (everywhere, and where the expert shifts the base); over experts:
    the skill most lost in each system and merge minus composition. The merge's values are None where no merged
    model was measured."""

    reads = MeasuredBatch

    def __init__(self, names: list[str]):
        self.names = names
        self.counts: rx.RetentionCounts | None = None
        self.merged = True  # False once a batch comes without the merge's measures

    def update(self, batch: MeasuredBatch) -> None:
        if batch.composed_top1 is None or batch.base_expert_logprob is None:
            return
        self.merged = self.merged and batch.expert_merged_kl is not None
        if self.merged:
            system_kl = torch.stack([batch.expert_merged_kl, batch.expert_composed_kl])  # (2, k, n)
            system_top1 = torch.stack([batch.merged_top1, batch.composed_top1])  # (2, n)
        else:  # the composition's row twice keeps the shapes; the merge's row is not reported
            system_kl = torch.stack([batch.expert_composed_kl, batch.expert_composed_kl])
            system_top1 = torch.stack([batch.composed_top1, batch.composed_top1])
        counts = rx.retention_counts(batch.top1, system_kl, system_top1, batch.base_expert_logprob)
        self.counts = counts if self.counts is None else rx.add_counts(self.counts, counts)

    def report(self) -> dict:
        """`{"experts": {name: {"retention": {"merge": {"kl_mean", "kept_share"} | None, "compose": {...}},
        "base_logprob_mean", "base_logprob_mean_shifted"}}, "retention": {"shifted_positions": {name: n},
        "most_lost": {"merge_kl_max", "compose_kl_max", "merge_kept_min", "compose_kept_min"},
        "merge_minus_compose": {"kl_max", "kept_min"}}}`; empty before any position. NaN (an expert that shifts
        no position) is None."""
        if self.counts is None or int(self.counts.positions) == 0:
            return {}
        values = rx.retention_measures(self.counts)
        systems = SYSTEMS if self.merged else SYSTEMS[1:]
        experts = {}
        for index, name in enumerate(self.names):
            kept = {
                system: {
                    "kl_mean": _value(values.kl_mean[row, index]),
                    "kept_share": _value(values.kept_share[row, index]),
                }
                for row, system in enumerate(SYSTEMS)
                if system in systems
            }
            experts[name] = {
                "retention": {"merge": kept.get("merge"), "compose": kept["compose"]},
                "base_logprob_mean": _value(values.base_logprob_mean[index]),
                "base_logprob_mean_shifted": _value(values.base_logprob_mean_shifted[index]),
            }
        most_lost = {}
        for row, system in enumerate(SYSTEMS):
            defined = system in systems
            most_lost[f"{system}_kl_max"] = _extreme(values.kl_mean[row], max) if defined else None
            most_lost[f"{system}_kept_min"] = _extreme(values.kept_share[row], min) if defined else None
        return {
            "experts": experts,
            "retention": {
                "shifted_positions": {name: int(self.counts.shifted[i]) for i, name in enumerate(self.names)},
                "most_lost": most_lost,
                "merge_minus_compose": {
                    "kl_max": _difference(most_lost["merge_kl_max"], most_lost["compose_kl_max"]),
                    "kept_min": _difference(most_lost["merge_kept_min"], most_lost["compose_kept_min"]),
                },
            },
        }


def _value(value: torch.Tensor) -> float | None:
    number = float(value)
    return None if math.isnan(number) else number


def _extreme(values: torch.Tensor, pick) -> float | None:
    """The largest (`max`) or least (`min`) of the defined values; None where none is defined."""
    defined = [float(value) for value in values if not math.isnan(float(value))]
    return pick(defined) if defined else None


def _difference(merge: float | None, compose: float | None) -> float | None:
    return None if merge is None or compose is None else merge - compose
