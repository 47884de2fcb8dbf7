"""The reducers of measured positions, and the protocol every reducer follows.

A `Reducer` keeps its own running sums: `update(batch)` adds one batch, `report()` reduces the
sums to its part of the report, a nested dict. `OverlapAccumulator` holds a list of reducers and
joins their parts with `merge_reports`, which refuses a key that two reducers both claim. The
reducers here read a `MeasuredBatch` (a chunk of measured positions); those of whole sequences
are in `mergecompose.analysis.sequence_reducers`.

* `ActivityReducer`: KL(p_i ‖ p_b), active fractions, co-activation;
* `KLHistogramReducer`: the histogram of KL(p_i ‖ p_b) per expert;
* `PairOverlapReducer`: mass overlap O_ij, sign conflict, support Jaccard, the delta-norm ratio;
* `Top1ShiftReducer`: per expert the top-1 shift rate, per pair where both shift and whether to one token;
* `TopTokenReducer`: the tokens each expert moves most;
* `ProjectiveErrorReducer`: single-active, dominant-shift and restricted projective errors;
* `MergeGapReducer`: KL(q ‖ m), top-1 agreement, interaction residual;
* `LinearizationReducer`: the linearization error of θ_b + λτ_i;
* `VocabularyReducer`: on the top-k union, the mass outside the measured tokens.

Each uses only the public pure functions of `mergecompose.analysis.diagnostics` and
`mergecompose.analysis.shift_diagnostics`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import torch

from mergecompose.analysis import delta_overlap as ox
from mergecompose.analysis import diagnostics as dx
from mergecompose.analysis import shift_diagnostics as sx
from mergecompose.analysis.measured_batch import MeasuredBatch, SequenceBatch
from mergecompose.analysis.overlap_settings import OverlapSettings
from mergecompose.analysis.summaries import LogHistogram, pair_key, token_labels


class Reducer(Protocol):
    """A running reduction over a stream of batches, in memory that does not grow with the stream.

    `reads` is the batch it takes: `MeasuredBatch` (a chunk of measured positions, possibly several
    per `OverlapAccumulator.update`) or `SequenceBatch` (a whole batch of sequences, once per update).
    `report()` returns this reducer's part of the report: nested dicts whose leaves no other reducer
    gives (`merge_reports`).
    """

    reads: ClassVar[type[MeasuredBatch] | type[SequenceBatch]]

    def update(self, batch: Any) -> None: ...

    def report(self) -> dict: ...


def merge_reports(parts: Sequence[tuple[str, dict]]) -> dict:
    """Join `(owner, part)` pairs into one report: dicts are merged key by key, in the order given;
    any other value (a number, a list, None) has one owner, and a second owner of its key is an error.

    Does not modify the parts; the values themselves are not copied.
    """
    merged: dict = {}
    owners: dict[tuple, str] = {}  # key path -> the first owner to give it
    for owner, part in parts:
        _merge_into(merged, part, owner, owners, ())
    return merged


def _merge_into(target: dict, part: dict, owner: str, owners: dict[tuple, str], path: tuple) -> None:
    for key, value in part.items():
        where = (*path, key)
        if where not in owners:
            owners[where] = owner
            target[key] = {} if isinstance(value, dict) else value
        elif not (isinstance(value, dict) and isinstance(target[key], dict)):
            raise ValueError(
                f"report key `{'.'.join(map(str, where))}` is given by both {owners[where]} and {owner}; "
                "each value of the report must come from one reducer"
            )
        if isinstance(value, dict):
            _merge_into(target[key], value, owner, owners, where)


class ActivityReducer:
    """Activity in time: per expert `KL(p_i ‖ p_b)` (mean, max, median) and active fractions;
    the co-activation rate `P(|A_t(ε)| ≥ 2)` and the distribution of `|A_t(ε)|`."""

    reads = MeasuredBatch

    def __init__(self, names: list[str], settings: OverlapSettings):
        k = len(names)
        self.names = names
        self.epsilons = settings.epsilons
        self.thresholds = [*settings.epsilons, settings.epsilon]  # last row: the headline ε
        self.positions = 0
        self.kl_sum = torch.zeros(k, dtype=torch.float64)
        self.kl_max = torch.zeros(k, dtype=torch.float64)
        self.kl_histograms = [LogHistogram() for _ in range(k)]
        self.active_count = torch.zeros(len(self.thresholds), k, dtype=torch.int64)
        self.coactive_count = torch.zeros(len(self.thresholds), dtype=torch.int64)
        self.active_set_sizes = torch.zeros(k + 1, dtype=torch.int64)

    def update(self, batch: MeasuredBatch) -> None:
        activity = batch.activity  # (k, N)
        self.positions += batch.num_positions
        self.kl_sum += activity.double().sum(1).cpu()
        self.kl_max = torch.maximum(self.kl_max, activity.double().amax(1).cpu())
        for histogram, values in zip(self.kl_histograms, activity):
            histogram.add(values)
        for row, epsilon in enumerate(self.thresholds):
            active_at = dx.active_experts(activity, epsilon)  # (k, N)
            self.active_count[row] += active_at.sum(1).cpu()
            self.coactive_count[row] += int((active_at.sum(0) >= 2).sum())
        self.active_set_sizes += torch.bincount(batch.active.sum(0).cpu(), minlength=len(self.active_set_sizes))

    def report(self) -> dict:
        """Top-level `coactivation_*` and `active_count_distribution`; per expert under "experts"."""
        n = max(self.positions, 1)
        experts = {
            name: {
                "kl_mean": float(self.kl_sum[index]) / n,
                "kl_max": float(self.kl_max[index]),
                "kl_median": min(self.kl_histograms[index].quantile(0.5), float(self.kl_max[index])),
                "active_fraction": float(self.active_count[-1, index]) / n,
                "active_fraction_by_epsilon": {
                    str(e): float(self.active_count[row, index]) / n for row, e in enumerate(self.epsilons)
                },
            }
            for index, name in enumerate(self.names)
        }
        return {
            "coactivation_rate": float(self.coactive_count[-1]) / n,
            "coactivation_by_epsilon": {
                str(e): float(self.coactive_count[row]) / n for row, e in enumerate(self.epsilons)
            },
            "active_count_distribution": (self.active_set_sizes.double() / n).tolist(),
            "experts": experts,
        }


class KLHistogramReducer:
    """Per expert, the histogram of `KL(p_i ‖ p_b)` over the positions (`LogHistogram`), for the report's
    `kl_histogram`. `ActivityReducer` keeps its own for the median, so that each part stands alone."""

    reads = MeasuredBatch

    def __init__(self, names: list[str]):
        self.names = names
        self.kl_histograms = [LogHistogram() for _ in names]

    def update(self, batch: MeasuredBatch) -> None:
        for histogram, values in zip(self.kl_histograms, batch.activity):  # (N,) each
            histogram.add(values)

    def report(self) -> dict:
        """`{"experts": {name: {"kl_histogram"}}}`."""
        return {
            "experts": {
                name: {"kl_histogram": histogram.to_dict()} for name, histogram in zip(self.names, self.kl_histograms)
            }
        }


class PairOverlapReducer:
    """Overlap over the vocabulary, per pair: the pooled mass overlap `O_ij`, its sign-conflict share,
    the Jaccard of the supports, co-activation, the mean `O_ij` where both are active, and the ratio of
    the two deltas' weighted RMS norms from the same sums (`delta_overlap.delta_norm_ratio`)."""

    reads = MeasuredBatch

    def __init__(self, names: list[str]):
        k = len(names)
        self.names = names
        self.pairs = [(i, j) for i in range(k) for j in range(i + 1, k)]
        self.positions = 0
        self.overlap_totals = torch.zeros(len(self.pairs), 4, dtype=torch.float64)  # the four `OverlapSums`
        self.coactive = torch.zeros(len(self.pairs), dtype=torch.int64)
        self.coactive_overlap_sum = torch.zeros(len(self.pairs), dtype=torch.float64)
        self.support_intersection = torch.zeros(len(self.pairs), dtype=torch.int64)
        self.support_union = torch.zeros(len(self.pairs), dtype=torch.int64)
        # On the top-k union: lower and upper bounds on the full `product`, `square_i`, `square_j`.
        self.restricted = False
        self.bound_totals = torch.zeros(len(self.pairs), 3, 2, dtype=torch.float64)

    def update(self, batch: MeasuredBatch) -> None:
        self.positions += batch.num_positions
        centred, supports = batch.centred, batch.supports  # (k, N, M), (k, N, M)
        for pair, (i, j) in enumerate(self.pairs):
            weight = ox.overlap_weights_from_probs(
                batch.base_probs, batch.expert_probs[i], batch.expert_probs[j], batch.composed_probs
            )  # (N, M)
            sums = ox.overlap_sums(centred[i], centred[j], weight)  # each (N,)
            self.overlap_totals[pair] += torch.stack([s.double().sum() for s in sums]).cpu()
            if batch.columns is not None:
                self.restricted = True
                self.bound_totals[pair] += self._sum_bounds(batch, weight, i, j)
            both = batch.active[i] & batch.active[j]  # (N,)
            self.coactive[pair] += int(both.sum())
            self.coactive_overlap_sum[pair] += float(ox.overlap_ratio(sums)[both].double().sum())
            self.support_intersection[pair] += int((supports[i] & supports[j]).sum())
            self.support_union[pair] += int((supports[i] | supports[j]).sum())

    @staticmethod
    def _sum_bounds(batch: MeasuredBatch, weight: torch.Tensor, i: int, j: int) -> torch.Tensor:
        """`(3, 2)`: lower and upper bounds on the full `product`, `square_i`, `square_j`, summed over the positions.

        The centre over V lies in `[c − below, c + above]` around the centre c on U, so on a token
        of U the full |δ̃_i| lies in `[a_min, a_max]`, the least and largest |δ_i − c'| over that
        interval; the full sums on U lie between the sums of those products. The tokens outside
        U add between 0 and `τ_w A_i A_j` (`τ_w A_i²`), with `A_i` the largest |δ_i − c| over V ∖ U and
        `τ_w ≤ τ_b + τ_i + τ_j + τ_q` their mass under w = max(p_b, p_i, p_j, q).
        """
        k = batch.experts.shape[0]
        w = weight.double()  # (N, M)

        def magnitude_range(index):  # the least and largest |δ_i − c'| on each token of U, (N, M) each
            centred = batch.centred[index].double()
            below = batch.centre_below[index].double()[:, None]
            above = batch.centre_above[index].double()[:, None]
            low_end, high_end = (centred + below).abs(), (centred - above).abs()
            inside = (centred >= -below) & (centred <= above)
            return torch.where(inside, 0.0, torch.minimum(low_end, high_end)), torch.maximum(low_end, high_end)

        (a_min, a_max), (b_min, b_max) = magnitude_range(i), magnitude_range(j)
        outside = batch.outside_mass.double()  # (k+2, N)
        tail = outside[0] + outside[1 + i] + outside[1 + j] + outside[k + 1]  # (N,)
        extent = batch.delta_extent.double()  # (k, N)
        bounds = [
            ((w * a_min * b_min).sum(-1), (w * a_max * b_max).sum(-1) + tail * extent[i] * extent[j]),
            ((w * a_min.square()).sum(-1), (w * a_max.square()).sum(-1) + tail * extent[i].square()),
            ((w * b_min.square()).sum(-1), (w * b_max.square()).sum(-1) + tail * extent[j].square()),
        ]
        return torch.tensor([[low.sum().item(), high.sum().item()] for low, high in bounds], dtype=torch.float64)

    def _bounds(self, pair: int) -> list[float] | None:
        """`[low, high]` holding the mass overlap over all V, from the bounds on its sums."""
        if not self.restricted:
            return None
        (product_low, product_high), (i_low, i_high), (j_low, j_high) = self.bound_totals[pair].tolist()
        if not all(math.isfinite(v) for v in (product_high, i_high, j_high)):
            return [0.0, 1.0]
        low_denominator, high_denominator = math.sqrt(i_low * j_low), math.sqrt(i_high * j_high)
        low = product_low / high_denominator if high_denominator > 0 else 0.0
        high = min(product_high / low_denominator, 1.0) if low_denominator > 0 else 1.0
        return [low, high]

    def report(self) -> dict:
        """`{"pairs": {"a|b": stats}}`; on the top-k union also `mass_overlap_bounds`, `[low, high]` for the
        full computation. `delta_norm_ratio` is None where one delta is 0 at every weighted token (unbounded)."""
        n = max(self.positions, 1)
        pairs = {}
        for pair, (i, j) in enumerate(self.pairs):
            sums = ox.OverlapSums(*self.overlap_totals[pair].unbind())
            coactive = int(self.coactive[pair])
            pairs[pair_key(self.names[i], self.names[j])] = {
                "mass_overlap": float(ox.overlap_ratio(sums)),
                "sign_conflict": float(ox.conflict_ratio(sums)),
                "sign_conflict_overlap": float(ox.overlap_ratio(sums) * ox.conflict_ratio(sums)),
                "support_jaccard": float(self.support_intersection[pair]) / max(int(self.support_union[pair]), 1),
                "coactivation_rate": coactive / n,
                "mass_overlap_coactive_mean": float(self.coactive_overlap_sum[pair]) / coactive if coactive else None,
                "delta_norm_ratio": _finite(float(ox.norm_ratio(sums))),
            }
            if self.restricted:
                pairs[pair_key(self.names[i], self.names[j])]["mass_overlap_bounds"] = self._bounds(pair)
        return {"pairs": pairs}


def _finite(value: float) -> float | None:
    """`value`, or None where it is inf or NaN (a ratio with a zero denominator)."""
    return value if math.isfinite(value) else None


class Top1ShiftReducer:
    """Top-1 token shifts (`mergecompose.analysis.shift_diagnostics`): per expert the share of positions where
    its top-1 token differs from the base's; per pair the share that both shift and, of those, the share
    where they shift to the same token (None where no position is shifted by both)."""

    reads = MeasuredBatch

    def __init__(self, names: list[str]):
        k = len(names)
        self.names = names
        self.pairs = [(i, j) for i in range(k) for j in range(i + 1, k)]
        self.counts = sx.ShiftCounts(
            positions=torch.zeros((), dtype=torch.int64),
            shifted=torch.zeros(k, dtype=torch.int64),
            both_shifted=torch.zeros(k, k, dtype=torch.int64),
            same_token=torch.zeros(k, k, dtype=torch.int64),
        )

    def update(self, batch: MeasuredBatch) -> None:
        counts = sx.shift_counts(batch.top1)  # over the batch's n positions
        self.counts = sx.ShiftCounts(*(total + part for total, part in zip(self.counts, counts)))

    def report(self) -> dict:
        """`{"experts": {name: {"top1_shift_rate"}}, "pairs": {"a|b": {"top1_both_shift_rate",
        "top1_same_shift_share"}}}`; empty before any position."""
        if int(self.counts.positions) == 0:
            return {}
        rates = sx.top1_shift_rate(self.counts)  # (k,)
        agreement = sx.shift_agreement(self.counts)  # (k, k) each
        return {
            "experts": {name: {"top1_shift_rate": float(rates[index])} for index, name in enumerate(self.names)},
            "pairs": {
                pair_key(self.names[i], self.names[j]): {
                    "top1_both_shift_rate": float(agreement.both_shift_rate[i, j]),
                    "top1_same_shift_share": _finite(float(agreement.same_token_share[i, j])),
                }
                for i, j in self.pairs
            },
        }


class TopTokenReducer:
    """Per expert, the tokens with the largest mean |δ̃_i| and how often each is in the support S_i. O(k·V).

    On the top-k union a token's |δ̃_i| counts only at the positions where it is in U (0 elsewhere)."""

    reads = MeasuredBatch

    def __init__(self, names: list[str], vocab_size: int, top_tokens: int, decode=None):
        self.names = names
        self.top_tokens = top_tokens
        self.decode = decode
        self.positions = 0
        self.abs_delta_sum = torch.zeros(len(names), vocab_size, dtype=torch.float64)
        self.support_count = torch.zeros(len(names), vocab_size, dtype=torch.int64)

    def update(self, batch: MeasuredBatch) -> None:
        self.positions += batch.num_positions
        if batch.columns is None:
            self.abs_delta_sum += batch.centred.abs().double().sum(1).cpu()
            self.support_count += batch.supports.sum(1).cpu()
            return
        # On the top-k union, a token adds its |δ̃| only at the positions where it is in U.
        columns = batch.columns.flatten().cpu()  # (N·M,)
        for index in range(len(self.names)):
            self.abs_delta_sum[index].index_add_(0, columns, batch.centred[index].abs().flatten().cpu().double())
            self.support_count[index].index_add_(0, columns, batch.supports[index].flatten().cpu().long())

    def report(self) -> dict:
        """`{"experts": {name: {"top_tokens": [{"token", "mean_abs_delta", "support_rate"}, …]}}}`, largest
        mean |δ̃| first."""
        n = max(self.positions, 1)
        result = {}
        for index, name in enumerate(self.names):
            mean_abs = self.abs_delta_sum[index] / n  # (V,)
            order = mean_abs.argsort(descending=True)[: self.top_tokens].tolist()
            result[name] = [
                {
                    "token": token_labels([token], self.decode)[0],
                    "mean_abs_delta": float(mean_abs[token]),
                    "support_rate": float(self.support_count[index, token]) / n,
                }
                for token in order
            ]
        return {"experts": {name: {"top_tokens": tokens} for name, tokens in result.items()}}


class ProjectiveErrorReducer:
    """Projective error: `KL(p_active ‖ q)` on steps with `|A_t| ≤ 1`; `KL(p_o ‖ q)` on steps where exactly
    one expert o shifts the base's top-1 token (`shift_diagnostics.dominant_shift_error`), defined where every
    step is co-active; and per expert the restricted
    `KL(p_i(·|S_i ∪ B) ‖ q(·|S_i ∪ B))`, over all positions and where the expert is active
    (on the top-k union: S_i ∪ B within U)."""

    reads = MeasuredBatch

    def __init__(self, names: list[str]):
        k = len(names)
        self.names = names
        self.positions = 0
        self.single_active_sum = 0.0
        self.single_active_count = 0
        self.single_active_histogram = LogHistogram()
        self.dominant_shift_sum = 0.0
        self.dominant_shift_count = 0
        self.restricted_sum = torch.zeros(k, dtype=torch.float64)
        self.restricted_max = torch.zeros(k, dtype=torch.float64)
        self.restricted_active_sum = torch.zeros(k, dtype=torch.float64)
        self.active_count = torch.zeros(k, dtype=torch.int64)

    def update(self, batch: MeasuredBatch) -> None:
        self.positions += batch.num_positions
        single, eligible = batch.single_active, batch.single_eligible  # (N,), over V
        self.single_active_sum += float(single[eligible].double().sum())
        self.single_active_count += int(eligible.sum())
        self.single_active_histogram.add(single[eligible])
        dominant, owned = sx.dominant_shift_error_from_tokens(batch.top1, batch.expert_composed_kl)  # (N,) each
        self.dominant_shift_sum += float(dominant[owned].double().sum())
        self.dominant_shift_count += int(owned.sum())
        restricted = dx.restricted_projective_error_from_logprobs(
            batch.experts, batch.expert_probs, batch.composed, batch.composed_probs, batch.supports
        )  # (k, N)
        self.restricted_sum += restricted.double().sum(1).cpu()
        self.restricted_max = torch.maximum(self.restricted_max, restricted.double().amax(1).cpu())
        self.restricted_active_sum += torch.where(batch.active, restricted, 0.0).double().sum(1).cpu()
        self.active_count += batch.active.sum(1).cpu()

    def report(self) -> dict:
        """`{"projective_error": stats, "experts": {name: stats}}`."""
        n = max(self.positions, 1)
        experts = {
            name: {
                "projective_error": float(self.restricted_sum[index]) / n,
                "projective_error_max": float(self.restricted_max[index]),
                # The same, only where the expert is active (a_{i,t} > ε): where its skill acts.
                "projective_error_active": (
                    float(self.restricted_active_sum[index]) / int(self.active_count[index])
                    if int(self.active_count[index])
                    else None
                ),
            }
            for index, name in enumerate(self.names)
        }
        count, owned = self.single_active_count, self.dominant_shift_count
        projective_error = {
            "single_active": self.single_active_sum / count if count else None,
            "single_active_fraction": count / n,
            "single_active_p95": self.single_active_histogram.quantile(0.95),
            "dominant_shift": self.dominant_shift_sum / owned if owned else None,
            "dominant_shift_fraction": owned / n,
            "per_expert": {name: stats["projective_error"] for name, stats in experts.items()},
        }
        return {"projective_error": projective_error, "experts": experts}


class MergeGapReducer:
    """Merge vs compose: `KL(q ‖ m)`, top-1 agreement and, given `θ_b + λτ_i`, the interaction residual
    (`mergecompose.analysis.diagnostics.interaction_residual`) against the composed logit change `Σ λ_i δ_i`."""

    reads = MeasuredBatch

    def __init__(self, weights: list[float], vocab_size: int):
        self.weights = weights
        self.vocab_size = vocab_size
        self.positions = 0
        self.gap_sum = 0.0
        self.gap_max = 0.0
        self.top1_agree = 0
        self.histogram = LogHistogram()
        self.residual_positions = 0
        self.residual_square_sum = 0.0
        self.signal_square_sum = 0.0

    def update(self, batch: MeasuredBatch) -> None:
        if batch.merge_gap is None:
            return
        n = batch.num_positions
        gap = batch.merge_gap  # (N,): KL(q ‖ m)
        self.positions += n
        self.gap_sum += float(gap.double().sum())
        self.gap_max = max(self.gap_max, float(gap.max()))
        self.top1_agree += int(batch.top1_agree.sum())
        self.histogram.add(gap)
        if batch.residual_square is None:
            return
        self.residual_positions += n
        self.residual_square_sum += float(batch.residual_square.sum())
        self.signal_square_sum += float(batch.signal_square.sum())

    def report(self) -> dict:
        """`{"merge_compose_gap": stats}`, with None for the stats when no merge was measured."""
        if not self.positions:
            return {"merge_compose_gap": None}
        gap = {
            "kl_mean": self.gap_sum / self.positions,
            "kl_max": self.gap_max,
            "kl_p95": min(self.histogram.quantile(0.95), self.gap_max),
            "top1_agreement": self.top1_agree / self.positions,
            "histogram": self.histogram.to_dict(),
        }
        if self.residual_positions:
            count = self.residual_positions * self.vocab_size
            gap["interaction_residual_rms"] = math.sqrt(self.residual_square_sum / count)
            gap["interaction_residual_relative"] = (
                math.sqrt(self.residual_square_sum / self.signal_square_sum) if self.signal_square_sum > 0 else None
            )
        return {"merge_compose_gap": gap}


class LinearizationReducer:
    """Per expert, the linearization error of `θ_b + λτ_i` (`mergecompose.analysis.diagnostics.linearization_error`);
    measured only when some λ ≠ 1 (at λ = 1 it is 0 by construction)."""

    reads = MeasuredBatch

    def __init__(self, names: list[str], weights: list[float]):
        self.names = names
        self.weights = weights
        self.positions = 0
        self.error_sum = torch.zeros(len(names), dtype=torch.float64)
        self.error_max = torch.zeros(len(names), dtype=torch.float64)

    def update(self, batch: MeasuredBatch) -> None:
        if batch.linearization is None:
            return
        self.positions += batch.num_positions
        for index, error in enumerate(batch.linearization):  # (N,) each
            self.error_sum[index] += float(error.double().sum())
            self.error_max[index] = max(float(self.error_max[index]), float(error.max()))

    def report(self) -> dict:
        """`{"experts": {name: {"linearization_error", "linearization_error_max"}}}`; empty when not measured."""
        if not self.positions:
            return {}
        experts = {
            name: {
                "linearization_error": float(self.error_sum[index]) / self.positions,
                "linearization_error_max": float(self.error_max[index]),
            }
            for index, name in enumerate(self.names)
        }
        return {"experts": experts}


class VocabularyReducer:
    """On the top-k union U: per distribution (base, each expert, composed) the mean and largest
    probability mass outside U; nothing when the full vocabulary is measured."""

    reads = MeasuredBatch

    def __init__(self, names: list[str], candidates: int):
        self.labels = ["base", *names, "composed"]
        self.candidates = candidates
        self.positions = 0
        self.outside_sum = torch.zeros(len(self.labels), dtype=torch.float64)
        self.outside_max = torch.zeros(len(self.labels), dtype=torch.float64)

    def update(self, batch: MeasuredBatch) -> None:
        if batch.outside_mass is None:
            return
        self.positions += batch.num_positions
        outside = batch.outside_mass.double().cpu()  # (k+2, N)
        self.outside_sum += outside.sum(1)
        self.outside_max = torch.maximum(self.outside_max, outside.amax(1))

    def report(self) -> dict:
        """`{"vocabulary": stats}`, with None for the stats when the full vocabulary was measured."""
        if not self.positions:
            return {"vocabulary": None}
        vocabulary = {
            "measured": "top_k_union",
            "candidates": self.candidates,
            "outside_mass_mean": {
                label: float(self.outside_sum[i]) / self.positions for i, label in enumerate(self.labels)
            },
            "outside_mass_max": {label: float(self.outside_max[i]) for i, label in enumerate(self.labels)},
        }
        return {"vocabulary": vocabulary}
