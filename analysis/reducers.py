"""The streaming reducers behind `OverlapAccumulator`, and the settings and summaries they share.

`MeasuredBatch` computes what every measure needs from one batch, once (normalised log-probs,
activity, centred deltas, supports); each reducer keeps its own running sums, with its own
`update(batch)` and `report()`:

* `ActivityReducer`: KL(p_i ‖ p_b), active fractions, co-activation;
* `IntervalReducer`: active intervals [τ1, τ2) per sequence and their pairwise overlap;
* `PairOverlapReducer`: mass overlap O_ij, sign conflict, support Jaccard;
* `TopTokenReducer`: the tokens each expert moves most;
* `ProjectiveErrorReducer`: single-active and restricted projective errors;
* `MergeGapReducer`: KL(q ‖ m), top-1 agreement, interaction residual;
* `LinearizationReducer`: the linearization error of θ_b + λτ_i;
* `ExampleReducer`: heatmap sequences and a reservoir of example positions.

Each uses only the public pure functions of `analysis.diagnostics`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from analysis import diagnostics as dx


class OverlapSettings(BaseModel):
    """Thresholds and sizes of the overlap diagnostics.

    * `epsilon`: the activity threshold (nats) for `A_t(ε)` used in the headline numbers, and
      the delta threshold for the supports `S_i`;
    * `epsilons`: the thresholds at which co-activation and active fractions are also reported;
    * `eta`: the probability floor of the supports;
    * `reservoir_size`, `top_k`: example positions kept for the report and the tokens shown
      for each; `heatmap_sequences`: sequences whose per-position activity is kept for the plot;
    * `top_tokens`: per expert, how many of the tokens with the largest mean |δ̃| are listed;
    * `centre`: how each delta is centred over the vocabulary before the overlap
      (`analysis.diagnostics.centred_deltas`): "median" (the issue's definition) or
      "base_weighted_median";
    * `seed`: the reservoir's random generator.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    epsilon: float = Field(0.1, ge=0)
    epsilons: list[float] = Field(default_factory=lambda: [0.01, 0.1, 1.0])
    eta: float = Field(1e-3, ge=0, lt=1)
    reservoir_size: int = Field(16, ge=0)
    top_k: int = Field(5, ge=1)
    heatmap_sequences: int = Field(8, ge=0)
    top_tokens: int = Field(10, ge=0)
    centre: Literal["median", "base_weighted_median"] = "median"
    seed: int = 0

    @field_validator("epsilons")
    @classmethod
    def _non_negative(cls, values: list[float]) -> list[float]:
        if not values or any(not v >= 0 for v in values):
            raise ValueError(f"`epsilons` must be a non-empty list of values >= 0, got {values}")
        return sorted(set(float(v) for v in values))


class LogHistogram:
    """Counts of non-negative values in log-spaced bins.

    Bin 0 holds `[0, low)` (exact zeros included), bins 1…n the log-spaced intervals
    `[e_{i−1}, e_i)` between `low` and `high`, and the last bin `[high, ∞]`.
    """

    def __init__(self, low: float = 1e-8, high: float = 1e2, bins_per_decade: int = 10):
        if not 0 < low < high:
            raise ValueError(f"need 0 < `low` < `high`, got low={low}, high={high}")
        decades = math.log10(high / low)
        self.edges = torch.logspace(math.log10(low), math.log10(high), round(decades * bins_per_decade) + 1, dtype=torch.float64)
        self.counts = torch.zeros(len(self.edges) + 1, dtype=torch.int64)

    def add(self, values: torch.Tensor) -> None:
        index = torch.bucketize(values.detach().double().flatten().cpu(), self.edges, right=True)
        self.counts += torch.bincount(index, minlength=len(self.counts))

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def quantile(self, fraction: float) -> float | None:
        """An upper bound on the `fraction` quantile: the upper edge of the bin that reaches it; None when empty."""
        if self.total == 0:
            return None
        cumulative = self.counts.cumsum(0).double() / self.total
        index = int(torch.searchsorted(cumulative, torch.tensor([fraction], dtype=torch.float64))[0])
        uppers = torch.cat([self.edges, torch.tensor([float("inf")], dtype=torch.float64)])
        return float(uppers[min(index, len(uppers) - 1)])

    def to_dict(self) -> dict:
        """`counts[0]` is `[0, edges[0])`, `counts[i]` is `[edges[i-1], edges[i])`, `counts[-1]` is `[edges[-1], ∞]`."""
        return {"edges": self.edges.tolist(), "counts": self.counts.tolist()}


class PositionReservoir:
    """Uniform sample of `size` positions from a stream (Vitter's Algorithm R), seeded.

    Item s of the stream (0-based) fills slot s while s < size; after that it replaces a
    uniformly drawn slot with probability size/(s+1). Every item ends up kept with equal
    probability size/n.
    """

    def __init__(self, size: int, seed: int = 0):
        self.size = size
        self.seen = 0
        self.items: list[dict | None] = [None] * size
        self.generator = torch.Generator().manual_seed(seed)

    def select(self, n: int) -> list[tuple[int, int]]:
        """Offer the next n items; return `(slot, index within these n)` to store, in order."""
        if self.size == 0 or n == 0:
            self.seen += n
            return []
        stream_index = torch.arange(self.seen, self.seen + n, dtype=torch.float64)
        draws = torch.floor(torch.rand(n, generator=self.generator, dtype=torch.float64) * (stream_index + 1)).long()
        slots = torch.where(stream_index < self.size, stream_index.long(), draws)
        self.seen += n
        keep = (slots < self.size).nonzero().flatten().tolist()
        return [(int(slots[i]), i) for i in keep]

    def store(self, slot: int, item: dict) -> None:
        self.items[slot] = item

    def samples(self) -> list[dict]:
        return [item for item in self.items if item is not None]


def pair_key(name_a: str, name_b: str) -> str:
    return f"{name_a}|{name_b}"


def token_labels(ids: list[int], decode=None) -> list:
    """Token strings where `decode` is known and gives text ("#id" where the text is empty), else the ids."""
    if decode is None:
        return ids
    return [decode([token]) or f"#{token}" for token in ids]


# ---------------------------------------------------------------------------------------------
# One batch, computed once


@dataclass
class MeasuredBatch:
    """What every reducer reads from one batch, computed once. N = the measured positions, row-major.

    Log-probs are re-normalised in float32 (`log_softmax`); the probabilities are their `exp`.
    """

    mask: torch.Tensor  # (B, T) bool, the measured positions
    base: torch.Tensor  # (N, V) log p_b
    experts: torch.Tensor  # (k, N, V) log p_i
    composed: torch.Tensor  # (N, V) log q
    base_probs: torch.Tensor  # (N, V)
    expert_probs: torch.Tensor  # (k, N, V)
    composed_probs: torch.Tensor  # (N, V)
    activity: torch.Tensor  # (k, N) a_i = KL(p_i ‖ p_b)
    active: torch.Tensor  # (k, N) bool, a_i > settings.epsilon
    activity_grid: torch.Tensor  # (k, B, T), 0 where not measured
    intervals: torch.Tensor  # (k, B, 2) active intervals [τ1, τ2); (-1, -1) where never active
    centred: torch.Tensor  # (k, N, V) centred deltas δ̃_i
    supports: torch.Tensor  # (k, N, V) bool supports S_i
    merged: torch.Tensor | None  # (N, V) log m
    scaled_experts: torch.Tensor | None  # (k, N, V) log-probs of θ_b + λτ_i, as given
    # The batch as given, for the examples.
    components: torch.Tensor  # (k+1, B, T, V)
    composed_grid: torch.Tensor  # (B, T, V)
    merged_grid: torch.Tensor | None  # (B, T, V)
    input_ids: torch.Tensor | None  # (B, T)
    attention_mask: torch.Tensor | None  # (B, T)

    @property
    def num_positions(self) -> int:
        return self.base.shape[0]

    @classmethod
    def select(
        cls, components, mask, composed, merged, scaled_experts, input_ids, attention_mask, settings: OverlapSettings
    ) -> MeasuredBatch:
        """Normalise the measured positions once and compute the shared measures (arguments: `OverlapAccumulator.update`)."""
        selected = torch.log_softmax(components[:, mask].float(), dim=-1)  # (k+1, N, V)
        base, experts = selected[0], selected[1:]  # (N, V), (k, N, V)
        log_q = torch.log_softmax(composed[mask].float(), dim=-1)  # (N, V)
        probs = selected.exp()
        base_probs, expert_probs = probs[0], probs[1:]
        activity = dx.kl_from_logprobs(experts, expert_probs, base)  # (k, N)
        activity_grid = torch.zeros(len(experts), *mask.shape, device=activity.device)  # (k, B, T)
        activity_grid[:, mask] = activity
        centred = dx.centred_deltas_from_logprobs(base, experts, centre=settings.centre, base_probs=base_probs)
        return cls(
            mask=mask,
            base=base,
            experts=experts,
            composed=log_q,
            base_probs=base_probs,
            expert_probs=expert_probs,
            composed_probs=log_q.exp(),
            activity=activity,
            active=dx.active_experts(activity, settings.epsilon),
            activity_grid=activity_grid,
            intervals=dx.active_intervals(activity_grid, settings.epsilon, mask),
            centred=centred,
            supports=dx.delta_supports_from_probs(centred, base_probs, expert_probs, settings.epsilon, settings.eta),
            merged=None if merged is None else torch.log_softmax(merged[mask].float(), dim=-1),
            scaled_experts=None if scaled_experts is None else scaled_experts[:, mask].float(),
            components=components,
            composed_grid=composed,
            merged_grid=merged,
            input_ids=input_ids,
            attention_mask=attention_mask,
        )


# ---------------------------------------------------------------------------------------------
# Reducers: each keeps its own running sums, `update(batch)` adds a `MeasuredBatch`, `report()`
# reduces the sums to numbers.


class ActivityReducer:
    """Activity in time: per expert `KL(p_i ‖ p_b)` (mean, max, histogram) and active fractions;
    the co-activation rate `P(|A_t(ε)| ≥ 2)` and the distribution of `|A_t(ε)|`."""

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
        """Top-level `coactivation_*` and `active_count_distribution`; per-expert stats and KL histograms."""
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
            "coactivation_by_epsilon": {str(e): float(self.coactive_count[row]) / n for row, e in enumerate(self.epsilons)},
            "active_count_distribution": (self.active_set_sizes.double() / n).tolist(),
            "experts": experts,
            "kl_histograms": {name: histogram.to_dict() for name, histogram in zip(self.names, self.kl_histograms)},
        }


class IntervalReducer:
    """Active intervals `[τ1, τ2)` per sequence: how often and how long each expert is active,
    and per pair how often the two intervals intersect and their mean IoU."""

    def __init__(self, names: list[str]):
        k = len(names)
        self.names = names
        self.pairs = [(i, j) for i in range(k) for j in range(i + 1, k)]
        self.sequences = 0
        self.sequences_active = torch.zeros(k, dtype=torch.int64)
        self.interval_length_sum = torch.zeros(k, dtype=torch.float64)
        self.pair_both_active = torch.zeros(k, k, dtype=torch.int64)
        self.pair_intersecting = torch.zeros(k, k, dtype=torch.int64)
        self.pair_iou_sum = torch.zeros(k, k, dtype=torch.float64)

    def update(self, batch: MeasuredBatch) -> None:
        self.sequences += int(batch.mask.any(-1).sum())
        intervals = batch.intervals  # (k, B, 2)
        active = intervals[..., 0] >= 0  # (k, B)
        lengths = (intervals[..., 1] - intervals[..., 0]).clamp(min=0)  # (k, B)
        self.sequences_active += active.sum(1).cpu()
        self.interval_length_sum += lengths.double().sum(1).cpu()
        intersections = dx.interval_intersections(intervals)  # (k, k, B)
        both = active[:, None] & active[None]  # (k, k, B)
        union = lengths[:, None] + lengths[None] - intersections
        iou = torch.where(both, intersections / union.clamp(min=1), torch.zeros(()))
        self.pair_both_active += both.sum(-1).cpu()
        self.pair_intersecting += (intersections > 0).sum(-1).cpu()
        self.pair_iou_sum += iou.double().sum(-1).cpu()

    def report(self) -> dict:
        """`{"experts": {name: stats}, "pairs": {"a|b": stats}}`."""
        sequences = max(self.sequences, 1)
        experts = {
            name: {
                "sequences_active_fraction": float(self.sequences_active[index]) / sequences,
                "interval_length_mean": float(self.interval_length_sum[index]) / max(int(self.sequences_active[index]), 1),
            }
            for index, name in enumerate(self.names)
        }
        pairs = {}
        for i, j in self.pairs:
            both = int(self.pair_both_active[i, j])
            pairs[pair_key(self.names[i], self.names[j])] = {
                "interval_overlap_rate": float(self.pair_intersecting[i, j]) / both if both else None,
                "interval_iou_mean": float(self.pair_iou_sum[i, j]) / both if both else None,
            }
        return {"experts": experts, "pairs": pairs}


class PairOverlapReducer:
    """Overlap over the vocabulary, per pair: the pooled mass overlap `O_ij`, its sign-conflict share,
    the Jaccard of the supports, co-activation and the mean `O_ij` where both are active."""

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

    def update(self, batch: MeasuredBatch) -> None:
        self.positions += batch.num_positions
        centred, supports = batch.centred, batch.supports  # (k, N, V), (k, N, V)
        for pair, (i, j) in enumerate(self.pairs):
            weight = dx.overlap_weights_from_probs(
                batch.base_probs, batch.expert_probs[i], batch.expert_probs[j], batch.composed_probs
            )  # (N, V)
            sums = dx.overlap_sums(centred[i], centred[j], weight)  # each (N,)
            self.overlap_totals[pair] += torch.stack([s.double().sum() for s in sums]).cpu()
            both = batch.active[i] & batch.active[j]  # (N,)
            self.coactive[pair] += int(both.sum())
            self.coactive_overlap_sum[pair] += float(dx.overlap_ratio(sums)[both].double().sum())
            self.support_intersection[pair] += int((supports[i] & supports[j]).sum())
            self.support_union[pair] += int((supports[i] | supports[j]).sum())

    def report(self) -> dict:
        """`{"a|b": stats}`."""
        n = max(self.positions, 1)
        pairs = {}
        for pair, (i, j) in enumerate(self.pairs):
            sums = dx.OverlapSums(*self.overlap_totals[pair].unbind())
            coactive = int(self.coactive[pair])
            pairs[pair_key(self.names[i], self.names[j])] = {
                "mass_overlap": float(dx.overlap_ratio(sums)),
                "sign_conflict": float(dx.conflict_ratio(sums)),
                "sign_conflict_overlap": float(dx.overlap_ratio(sums) * dx.conflict_ratio(sums)),
                "support_jaccard": float(self.support_intersection[pair]) / max(int(self.support_union[pair]), 1),
                "coactivation_rate": coactive / n,
                "mass_overlap_coactive_mean": float(self.coactive_overlap_sum[pair]) / coactive if coactive else None,
            }
        return pairs


class TopTokenReducer:
    """Per expert, the tokens with the largest mean |δ̃_i| and how often each is in the support S_i. O(k·V)."""

    def __init__(self, names: list[str], vocab_size: int, top_tokens: int, decode=None):
        self.names = names
        self.top_tokens = top_tokens
        self.decode = decode
        self.positions = 0
        self.abs_delta_sum = torch.zeros(len(names), vocab_size, dtype=torch.float64)
        self.support_count = torch.zeros(len(names), vocab_size, dtype=torch.int64)

    def update(self, batch: MeasuredBatch) -> None:
        self.positions += batch.num_positions
        self.abs_delta_sum += batch.centred.abs().double().sum(1).cpu()
        self.support_count += batch.supports.sum(1).cpu()

    def report(self) -> dict:
        """`{name: [{"token", "mean_abs_delta", "support_rate"}, …]}`, largest mean |δ̃| first."""
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
        return result


class ProjectiveErrorReducer:
    """Projective error: `KL(p_active ‖ q)` on steps with `|A_t| ≤ 1`, and per expert the restricted
    `KL(p_i(·|S_i ∪ B) ‖ q(·|S_i ∪ B))`, over all positions and where the expert is active."""

    def __init__(self, names: list[str]):
        k = len(names)
        self.names = names
        self.positions = 0
        self.single_active_sum = 0.0
        self.single_active_count = 0
        self.single_active_histogram = LogHistogram()
        self.restricted_sum = torch.zeros(k, dtype=torch.float64)
        self.restricted_max = torch.zeros(k, dtype=torch.float64)
        self.restricted_active_sum = torch.zeros(k, dtype=torch.float64)
        self.active_count = torch.zeros(k, dtype=torch.int64)

    def update(self, batch: MeasuredBatch) -> None:
        self.positions += batch.num_positions
        single, eligible = dx.single_active_error_from_logprobs(batch.base, batch.experts, batch.composed, batch.active)
        self.single_active_sum += float(single[eligible].double().sum())
        self.single_active_count += int(eligible.sum())
        self.single_active_histogram.add(single[eligible])
        restricted = dx.restricted_projective_error_from_logprobs(
            batch.experts, batch.expert_probs, batch.composed, batch.composed_probs, batch.supports
        )  # (k, N)
        self.restricted_sum += restricted.double().sum(1).cpu()
        self.restricted_max = torch.maximum(self.restricted_max, restricted.double().amax(1).cpu())
        self.restricted_active_sum += torch.where(batch.active, restricted, 0.0).double().sum(1).cpu()
        self.active_count += batch.active.sum(1).cpu()

    def report(self) -> dict:
        """The report's `projective_error` section, and per-expert stats under "experts"."""
        n = max(self.positions, 1)
        experts = {
            name: {
                "projective_error": float(self.restricted_sum[index]) / n,
                "projective_error_max": float(self.restricted_max[index]),
                # The same, only where the expert is active (a_{i,t} > ε): where its skill acts.
                "projective_error_active": (
                    float(self.restricted_active_sum[index]) / int(self.active_count[index])
                    if int(self.active_count[index]) else None
                ),
            }
            for index, name in enumerate(self.names)
        }
        count = self.single_active_count
        return {
            "single_active": self.single_active_sum / count if count else None,
            "single_active_fraction": count / n,
            "single_active_p95": self.single_active_histogram.quantile(0.95),
            "per_expert": {name: stats["projective_error"] for name, stats in experts.items()},
            "experts": experts,
        }


class MergeGapReducer:
    """Merge vs compose: `KL(q ‖ m)`, top-1 agreement and, given `θ_b + λτ_i`, the interaction residual
    (`analysis.diagnostics.interaction_residual`) against the composed logit change `Σ λ_i δ_i`."""

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
        if batch.merged is None:
            return
        n = batch.num_positions
        gap = dx.kl_from_logprobs(batch.composed, batch.composed_probs, batch.merged)  # (N,): KL(q ‖ m)
        self.positions += n
        self.gap_sum += float(gap.double().sum())
        self.gap_max = max(self.gap_max, float(gap.max()))
        self.top1_agree += int(dx.top1_agreement(batch.composed, batch.merged).sum())
        self.histogram.add(gap)
        if batch.scaled_experts is None:
            return
        residual = dx.interaction_residual(batch.merged, batch.scaled_experts, batch.base)  # (N, V)
        lam = torch.tensor(self.weights, device=batch.base.device)[:, None, None]
        signal = dx.centre((lam * (batch.experts - batch.base)).sum(0))  # (N, V): the composed logit change
        self.residual_positions += n
        self.residual_square_sum += float(residual.double().square().sum())
        self.signal_square_sum += float(signal.double().square().sum())

    def report(self) -> dict | None:
        """The report's `merge_compose_gap` section; None when no merge was measured."""
        if not self.positions:
            return None
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
        return gap


class LinearizationReducer:
    """Per expert, the linearization error of `θ_b + λτ_i` (`analysis.diagnostics.linearization_error`);
    measured only when some λ ≠ 1 (at λ = 1 it is 0 by construction)."""

    def __init__(self, names: list[str], weights: list[float]):
        self.names = names
        self.weights = weights
        self.positions = 0
        self.error_sum = torch.zeros(len(names), dtype=torch.float64)
        self.error_max = torch.zeros(len(names), dtype=torch.float64)

    def update(self, batch: MeasuredBatch) -> None:
        if batch.scaled_experts is None or all(w == 1.0 for w in self.weights):
            return
        self.positions += batch.num_positions
        for index, lam in enumerate(self.weights):
            error = dx.linearization_error(batch.scaled_experts[index], batch.base, batch.experts[index], lam)  # (N,)
            self.error_sum[index] += float(error.double().sum())
            self.error_max[index] = max(float(self.error_max[index]), float(error.max()))

    def report(self) -> dict:
        """`{name: {"linearization_error", "linearization_error_max"}}`; empty when not measured."""
        if not self.positions:
            return {}
        return {
            name: {
                "linearization_error": float(self.error_sum[index]) / self.positions,
                "linearization_error_max": float(self.error_max[index]),
            }
            for index, name in enumerate(self.names)
        }


class ExampleReducer:
    """Examples for the report: the per-position activity and intervals of the first
    `heatmap_sequences` sequences, and a uniform reservoir of positions with every component's top tokens."""

    def __init__(self, names: list[str], settings: OverlapSettings, decode=None):
        self.names = names
        self.heatmap_sequences = settings.heatmap_sequences
        self.top_k = settings.top_k
        self.decode = decode
        self.sequences = 0
        self.heatmap: list[dict] = []
        self.reservoir = PositionReservoir(settings.reservoir_size, settings.seed)

    def update(self, batch: MeasuredBatch) -> None:
        rows = batch.mask.any(-1).nonzero().flatten().tolist()
        first_sequence = self.sequences
        self.sequences += len(rows)
        self._update_heatmap(batch, rows, first_sequence)
        self._update_reservoir(batch, rows, first_sequence)

    def _update_heatmap(self, batch: MeasuredBatch, rows: list[int], first_sequence: int) -> None:
        mask, input_ids = batch.mask, batch.input_ids
        for offset, row in enumerate(rows):
            if len(self.heatmap) >= self.heatmap_sequences:
                break
            columns = mask[row].nonzero().flatten()
            # Each expert's [τ1, τ2) as indices into this row's measured positions; None if never active.
            measured_index = mask[row].long().cumsum(0) - 1
            row_intervals = [
                None if start < 0 else [int(measured_index[start]), int(measured_index[end - 1]) + 1]
                for start, end in batch.intervals[:, row].tolist()
            ]
            # Position t predicts token t+1: label each column with the token it predicts.
            next_tokens = None
            if input_ids is not None:
                padded = torch.cat([input_ids[row], input_ids.new_full((1,), -1)])
                next_tokens = [None if t < 0 else token_labels([t], self.decode)[0] for t in padded[columns + 1].tolist()]
            self.heatmap.append(
                {
                    "sequence": first_sequence + offset,
                    "activity": batch.activity_grid[:, row, columns].cpu().tolist(),  # (k, n_row)
                    "next_tokens": next_tokens,
                    "intervals": row_intervals,
                }
            )

    def _update_reservoir(self, batch: MeasuredBatch, rows: list[int], first_sequence: int) -> None:
        input_ids, attention_mask = batch.input_ids, batch.attention_mask
        named = [("base", batch.components[0]), *zip(self.names, batch.components[1:]), ("composed", batch.composed_grid)]
        if batch.merged_grid is not None:
            named.append(("merged", batch.merged_grid))
        flat = batch.mask.nonzero()  # (N, 2): (row, column)
        for slot, index in self.reservoir.select(flat.shape[0]):
            row, column = flat[index].tolist()
            entry = {
                "sequence": first_sequence + rows.index(row),
                "column": column,
                "position": column if attention_mask is None else int(attention_mask[row, :column].sum()),
                "activity": batch.activity_grid[:, row, column].cpu().tolist(),
            }
            if input_ids is not None:
                start = max(0, column - 15)
                context = input_ids[row, start : column + 1]
                if attention_mask is not None:
                    context = context[attention_mask[row, start : column + 1].bool()]
                entry["context"] = token_labels(context.tolist(), self.decode)
                if column + 1 < input_ids.shape[1]:
                    entry["next_token"] = token_labels([int(input_ids[row, column + 1])], self.decode)[0]
            entry["top"] = {name: self._top(tensor[row, column]) for name, tensor in named}
            self.reservoir.store(slot, entry)

    def _top(self, logprobs: torch.Tensor) -> list[list]:
        values, ids = logprobs.float().topk(min(self.top_k, logprobs.shape[-1]))
        labels = token_labels(ids.tolist(), self.decode)
        return [[label, round(value, 4)] for label, value in zip(labels, values.tolist())]

    def report(self) -> dict:
        return {"heatmap": self.heatmap, "reservoir": self.reservoir.samples()}


# ---------------------------------------------------------------------------------------------
