"""Where expert logit deltas overlap, whether the composition is projective, and whether merging ≈ composing.

Pure diagnostics on tensors live in `mergecompose.analysis.diagnostics` (the overlap of the experts' deltas
over the vocabulary in `mergecompose.analysis.delta_overlap`, those of their top-1 token shifts in
`mergecompose.analysis.shift_diagnostics`, which of the merge and the composition keeps each expert's top-1
decisions in `mergecompose.analysis.retention`); `OverlapAccumulator` streams them over batches in O(k·V + bins)
memory; `measure_overlap` runs a `ComposedLM` (and a merge) over batches and returns an `OverlapReport`.
"""

from mergecompose.analysis.delta_overlap import (
    centred_deltas,
    delta_norm_ratio,
    delta_supports,
    overlap_weights,
    sign_conflict_mass,
    weighted_median,
    weighted_overlap,
)
from mergecompose.analysis.diagnostics import (
    active_experts,
    active_intervals,
    coactivation_rate,
    conditional_kl,
    expert_activity,
    interaction_residual,
    interval_intersections,
    kl_divergence,
    linearization_error,
    merge_compose_gap,
    restricted_projective_error,
    single_active_error,
    top1_agreement,
)
from mergecompose.analysis.measure import measure_overlap, rollout_batches
from mergecompose.analysis.overlap_settings import OverlapSettings
from mergecompose.analysis.paired_outcome import PairedOutcome, paired_outcome
from mergecompose.analysis.retention import Retention, RetentionCounts, retention_counts, retention_measures
from mergecompose.analysis.sequential_decision import (
    BettingConfidenceSequence,
    Decision,
    DecisionSettings,
    SequentialDecision,
    decide_sequence,
    replay_orders,
)
from mergecompose.analysis.shift_diagnostics import (
    dominant_shift_error,
    shift_agreement,
    shift_counts,
    top1_shift_rate,
    top1_shifts,
    top1_tokens,
)
from mergecompose.analysis.streaming import OverlapAccumulator, OverlapReport

__all__ = [
    "BettingConfidenceSequence",
    "Decision",
    "DecisionSettings",
    "OverlapAccumulator",
    "OverlapReport",
    "OverlapSettings",
    "PairedOutcome",
    "Retention",
    "RetentionCounts",
    "SequentialDecision",
    "active_experts",
    "active_intervals",
    "centred_deltas",
    "coactivation_rate",
    "conditional_kl",
    "delta_norm_ratio",
    "decide_sequence",
    "delta_supports",
    "dominant_shift_error",
    "expert_activity",
    "interaction_residual",
    "interval_intersections",
    "kl_divergence",
    "linearization_error",
    "measure_overlap",
    "merge_compose_gap",
    "overlap_weights",
    "paired_outcome",
    "replay_orders",
    "restricted_projective_error",
    "retention_counts",
    "retention_measures",
    "rollout_batches",
    "shift_agreement",
    "shift_counts",
    "sign_conflict_mass",
    "single_active_error",
    "top1_agreement",
    "top1_shift_rate",
    "top1_shifts",
    "top1_tokens",
    "weighted_median",
    "weighted_overlap",
]
