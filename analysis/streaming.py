"""Streaming reduction of the diagnostics: chunks of positions in, scalars and histograms out.

`OverlapAccumulator.update` takes the component log-probs of one batch, reduces them at once
to running sums, log-spaced histograms, per-vocabulary accumulators and a small reservoir of
example positions, and drops the batch. Memory is O(k·V + k² + bins + reservoir), independent
of the number of tokens: no `(N, V)` tensor for the whole data set is ever kept.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from analysis import diagnostics as dx
from composition.rule import compose_logprobs


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

    model_config = ConfigDict(extra="forbid")

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

    def quantile(self, fraction: float) -> float:
        """An upper bound on the `fraction` quantile: the upper edge of the bin that reaches it."""
        if self.total == 0:
            return float("nan")
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


@dataclass
class OverlapReport:
    """What `OverlapAccumulator.report()` returns; `to_dict()` is the content of overlap.json.

    * `coactivation_rate`: `P(|A_t(ε)| ≥ 2)` at `settings.epsilon`, and per ε in
      `coactivation_by_epsilon`;
    * `experts[name]`: `kl_mean` (mean `KL(p_i ‖ p_b)`), `active_fraction`, interval statistics,
      `projective_error` (mean restricted KL), the tokens it moves most, the KL histogram;
    * `pairs["a|b"]`: `mass_overlap` (O_ij pooled over all positions and tokens),
      `sign_conflict` (conflicting share of that overlap), `support_jaccard`, co-activation and
      interval overlap of the two, `parameter` (task-vector measures, when known);
    * `projective_error`: `single_active` (mean `KL(p_active ‖ q)` over steps with `|A_t| ≤ 1`)
      and `per_expert`;
    * `merge_compose_gap`: `kl_mean` of `KL(q ‖ m)`, `top1_agreement`, the interaction residual,
      the histogram (present when a merged model was measured);
    * `reservoir`: example positions with the top tokens of every component.
    """

    num_positions: int
    num_sequences: int
    settings: dict
    coactivation_rate: float
    coactivation_by_epsilon: dict[str, float]
    active_count_distribution: list[float]
    experts: dict[str, dict]
    pairs: dict[str, dict]
    projective_error: dict
    merge_compose_gap: dict | None
    heatmap: list[dict]
    reservoir: list[dict]
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        """`to_dict()` without the bulky parts (examples, heatmap, histograms); top tokens cut to 5."""
        result = self.to_dict()
        for key in ("heatmap", "reservoir"):
            result.pop(key)
        for stats in result["experts"].values():
            stats.pop("kl_histogram")
            stats["top_tokens"] = stats["top_tokens"][:5]
        if "merge_compose_gap" in result:
            result["merge_compose_gap"].pop("histogram")
        return result

    def to_dict(self) -> dict:
        result = asdict(self)
        extra = result.pop("extra")
        if result["merge_compose_gap"] is None:
            del result["merge_compose_gap"]
        result.update(extra)
        return result


def pair_key(name_a: str, name_b: str) -> str:
    return f"{name_a}|{name_b}"


class OverlapAccumulator:
    """Running reduction of the overlap diagnostics over batches of positions.

    Args:
        expert_names: the k experts, in the order of the component tensors after the base.
        vocab_size: V.
        weights: the composition exponents `w_i` (also the λ of the merge being compared);
            default 1.0 each.
        settings: thresholds and sizes (`OverlapSettings`).
        decode: optional `token ids -> str`, used for the report's token lists and examples.
    """

    def __init__(
        self,
        expert_names: Sequence[str],
        vocab_size: int,
        weights: Sequence[float] | None = None,
        settings: OverlapSettings | None = None,
        decode=None,
    ):
        if len(expert_names) == 0:
            raise ValueError("`expert_names` must name at least one expert, got none")
        if len(set(expert_names)) != len(expert_names):
            raise ValueError(f"`expert_names` must be unique, got {list(expert_names)}")
        if weights is not None and len(weights) != len(expert_names):
            raise ValueError(f"`weights` must hold one weight per expert ({len(expert_names)}), got {len(weights)}")
        self.names = list(expert_names)
        self.k = len(self.names)
        self.vocab_size = int(vocab_size)
        self.weights = [1.0] * self.k if weights is None else [float(w) for w in weights]
        self.settings = settings or OverlapSettings()
        self.decode = decode
        self.pairs = [(i, j) for i in range(self.k) for j in range(i + 1, self.k)]
        k, V = self.k, self.vocab_size
        epsilons = self.settings.epsilons

        self.positions = 0
        self.sequences = 0
        # Activity.
        self.kl_sum = torch.zeros(k, dtype=torch.float64)
        self.kl_max = torch.zeros(k, dtype=torch.float64)
        self.active_count = torch.zeros(len(epsilons) + 1, k, dtype=torch.int64)  # last row: settings.epsilon
        self.coactive_count = torch.zeros(len(epsilons) + 1, dtype=torch.int64)
        self.active_set_sizes = torch.zeros(k + 1, dtype=torch.int64)
        self.kl_histograms = [LogHistogram() for _ in range(k)]
        # Intervals, per sequence.
        self.sequences_active = torch.zeros(k, dtype=torch.int64)
        self.interval_length_sum = torch.zeros(k, dtype=torch.float64)
        self.pair_both_active = torch.zeros(k, k, dtype=torch.int64)
        self.pair_intersecting = torch.zeros(k, k, dtype=torch.int64)
        self.pair_iou_sum = torch.zeros(k, k, dtype=torch.float64)
        self.pair_coactive = torch.zeros(k, k, dtype=torch.int64)
        # Vocabulary: O(k·V).
        self.abs_delta_sum = torch.zeros(k, V, dtype=torch.float64)
        self.support_count = torch.zeros(k, V, dtype=torch.int64)
        # Pairs: the four weighted sums, pooled over positions.
        self.overlap_totals = torch.zeros(k, k, 4, dtype=torch.float64)
        self.coactive_overlap_sum = torch.zeros(k, k, dtype=torch.float64)
        self.support_intersection = torch.zeros(k, k, dtype=torch.int64)
        self.support_union = torch.zeros(k, k, dtype=torch.int64)
        # Projective error.
        self.single_active_sum = 0.0
        self.single_active_count = 0
        self.restricted_sum = torch.zeros(k, dtype=torch.float64)
        self.restricted_max = torch.zeros(k, dtype=torch.float64)
        self.restricted_active_sum = torch.zeros(k, dtype=torch.float64)
        self.single_active_histogram = LogHistogram()
        # Linear equivalence.
        self.merged_positions = 0
        self.gap_sum = 0.0
        self.gap_max = 0.0
        self.top1_agree = 0
        self.gap_histogram = LogHistogram()
        self.residual_positions = 0
        self.residual_square_sum = 0.0
        self.signal_square_sum = 0.0
        self.linearization_positions = 0
        self.linearization_sum = torch.zeros(k, dtype=torch.float64)
        self.linearization_max = torch.zeros(k, dtype=torch.float64)
        # Examples.
        self.heatmap: list[dict] = []
        self.reservoir = PositionReservoir(self.settings.reservoir_size, self.settings.seed)

    # ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def update(
        self,
        components: torch.Tensor,
        mask: torch.Tensor,
        composed: torch.Tensor | None = None,
        merged: torch.Tensor | None = None,
        scaled_experts: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> None:
        """Add one batch.

        Args:
            components: `(k+1, B, T, V)` log-probs, base first (`ComposedLM.component_logprobs`).
            mask: `(B, T)` bool, the positions to measure (padding and unmeasured positions 0).
            composed: `(B, T, V)` composed log-probs; computed with `compose_logprobs` and
                `weights` when omitted.
            merged: `(B, T, V)` log-probs of the merge `θ_b + λΣτ_i`, optional.
            scaled_experts: `(k, B, T, V)` log-probs of `θ_b + λτ_i` per expert, optional. When
                every weight is 1 these are the experts themselves and need not be given.
            input_ids: `(B, T)`, optional; used to label example positions.
            attention_mask: `(B, T)`, optional; padding is left out of the examples' context.
        """
        k, V = self.k, self.vocab_size
        if components.dim() != 4 or components.shape[0] != k + 1 or components.shape[-1] != V:
            raise ValueError(
                f"`components` must be (k+1, batch, seq, V) = ({k + 1}, B, T, {V}), got {tuple(components.shape)}"
            )
        batch_shape = tuple(components.shape[1:3])
        if tuple(mask.shape) != batch_shape:
            raise ValueError(f"`mask` must be (batch, seq) = {batch_shape}, got {tuple(mask.shape)}")
        for name, tensor, lead in [("composed", composed, ()), ("merged", merged, ()), ("scaled_experts", scaled_experts, (k,))]:
            if tensor is not None and tuple(tensor.shape) != (*lead, *batch_shape, V):
                raise ValueError(f"`{name}` must have shape {(*lead, *batch_shape, V)}, got {tuple(tensor.shape)}")

        mask = mask.bool().to(components.device)
        if composed is None:
            composed = compose_logprobs(components[0], list(components[1:]), self.weights)  # (B, T, V)
        if scaled_experts is None and merged is not None and all(w == 1.0 for w in self.weights):
            scaled_experts = components[1:]  # θ_b + 1·τ_i = θ_i

        n = int(mask.sum())
        if n == 0:
            return
        settings = self.settings
        # Normalise and exponentiate once; the kernels below take log-probs and probabilities.
        selected = torch.log_softmax(components[:, mask].float(), dim=-1)  # (k+1, N, V)
        base, experts = selected[0], selected[1:]  # (N, V), (k, N, V)
        q = torch.log_softmax(composed[mask].float(), dim=-1)  # (N, V)
        probs = selected.exp()
        base_p, experts_p, q_p = probs[0], probs[1:], q.exp()

        # 1. Activity in time.
        activity = dx._kl(experts, experts_p, base)  # (k, N): KL(p_i ‖ p_b)
        self.kl_sum += activity.double().sum(1).cpu()
        self.kl_max = torch.maximum(self.kl_max, activity.double().amax(1).cpu())
        for index in range(k):
            self.kl_histograms[index].add(activity[index])
        for row, epsilon in enumerate([*settings.epsilons, settings.epsilon]):
            active_at = dx.active_experts(activity, epsilon)  # (k, N)
            self.active_count[row] += active_at.sum(1).cpu()
            self.coactive_count[row] += int((active_at.sum(0) >= 2).sum())
        active = dx.active_experts(activity, settings.epsilon)  # (k, N)
        self.active_set_sizes += torch.bincount(active.sum(0).cpu(), minlength=k + 1)

        activity_grid = torch.zeros(k, *batch_shape, device=activity.device)  # (k, B, T)
        activity_grid[:, mask] = activity
        intervals = self._update_intervals(activity_grid, mask)  # (k, B, 2)

        # 2. Overlap over the vocabulary.
        centred = dx._centred(base, experts, centre=settings.centre, base_probs=base_p)  # (k, N, V)
        supports = dx._supports(centred, base_p, experts_p, settings.epsilon, settings.eta)  # (k, N, V)
        self.abs_delta_sum += centred.abs().double().sum(1).cpu()
        self.support_count += supports.sum(1).cpu()
        for i, j in self.pairs:
            weight = dx._weights(base_p, experts_p[i], experts_p[j], q_p)  # (N, V)
            sums = dx.overlap_sums(centred[i], centred[j], weight)  # each (N,)
            self.overlap_totals[i, j] += torch.stack([s.double().sum() for s in sums]).cpu()
            both = active[i] & active[j]  # (N,)
            self.pair_coactive[i, j] += int(both.sum())
            self.coactive_overlap_sum[i, j] += float(dx.overlap_ratio(sums)[both].double().sum())
            self.support_intersection[i, j] += int((supports[i] & supports[j]).sum())
            self.support_union[i, j] += int((supports[i] | supports[j]).sum())

        # 3. Projective error.
        single, eligible = dx._single_active(base, experts, q, active)  # (N,), (N,)
        self.single_active_sum += float(single[eligible].double().sum())
        self.single_active_count += int(eligible.sum())
        self.single_active_histogram.add(single[eligible])
        restricted = dx._restricted(experts, experts_p, q, q_p, supports)  # (k, N)
        self.restricted_sum += restricted.double().sum(1).cpu()
        self.restricted_max = torch.maximum(self.restricted_max, restricted.double().amax(1).cpu())
        self.restricted_active_sum += torch.where(active, restricted, 0.0).double().sum(1).cpu()

        # 4. Linear equivalence.
        m = None
        if merged is not None:
            m = torch.log_softmax(merged[mask].float(), dim=-1)  # (N, V)
            gap = dx._kl(q, q_p, m)  # (N,): KL(q ‖ m)
            self.merged_positions += n
            self.gap_sum += float(gap.double().sum())
            self.gap_max = max(self.gap_max, float(gap.max()))
            self.top1_agree += int(dx.top1_agreement(q, m).sum())
            self.gap_histogram.add(gap)
        if scaled_experts is not None:
            scaled = scaled_experts[:, mask].float()  # (k, N, V)
            if m is not None:
                residual = dx.interaction_residual(m, scaled, base)  # (N, V)
                lam = torch.tensor(self.weights, device=base.device)[:, None, None]
                signal = dx.centre((lam * (experts - base)).sum(0))  # (N, V): the composed logit change
                self.residual_positions += n
                self.residual_square_sum += float(residual.double().square().sum())
                self.signal_square_sum += float(signal.double().square().sum())
            if any(w != 1.0 for w in self.weights):
                self.linearization_positions += n
                for index in range(k):
                    error = dx.linearization_error(scaled[index], base, experts[index], self.weights[index])
                    self.linearization_sum[index] += float(error.double().sum())
                    self.linearization_max[index] = max(float(self.linearization_max[index]), float(error.max()))

        self._update_examples(components, composed, merged, activity_grid, intervals, mask, input_ids, attention_mask)
        self.positions += n

    def _update_intervals(self, activity_grid: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        has_positions = mask.any(-1)  # (B,)
        self.sequences += int(has_positions.sum())
        intervals = dx.active_intervals(activity_grid, self.settings.epsilon, mask)  # (k, B, 2)
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
        return intervals

    def _update_examples(self, components, composed, merged, activity_grid, intervals, mask, input_ids, attention_mask) -> None:
        settings = self.settings
        rows = mask.any(-1).nonzero().flatten().tolist()
        first_sequence = self.sequences - len(rows)
        for offset, row in enumerate(rows):
            if len(self.heatmap) >= settings.heatmap_sequences:
                break
            columns = mask[row].nonzero().flatten()
            # Each expert's [τ1, τ2) as indices into this row's measured positions; None if never active.
            measured_index = mask[row].long().cumsum(0) - 1
            row_intervals = [
                None if start < 0 else [int(measured_index[start]), int(measured_index[end - 1]) + 1]
                for start, end in intervals[:, row].tolist()
            ]
            # Position t predicts token t+1: label each column with the token it predicts.
            next_tokens = None
            if input_ids is not None:
                padded = torch.cat([input_ids[row], input_ids.new_full((1,), -1)])
                next_tokens = [None if t < 0 else self._tokens([t])[0] for t in padded[columns + 1].tolist()]
            self.heatmap.append(
                {
                    "sequence": first_sequence + offset,
                    "activity": activity_grid[:, row, columns].cpu().tolist(),  # (k, n_row)
                    "next_tokens": next_tokens,
                    "intervals": row_intervals,
                }
            )
        flat = mask.nonzero()  # (N, 2): (row, column)
        for slot, index in self.reservoir.select(flat.shape[0]):
            row, column = flat[index].tolist()
            entry = {
                "sequence": first_sequence + rows.index(row),
                "column": column,
                "position": column if attention_mask is None else int(attention_mask[row, :column].sum()),
                "activity": activity_grid[:, row, column].cpu().tolist(),
            }
            if input_ids is not None:
                start = max(0, column - 15)
                context = input_ids[row, start : column + 1]
                if attention_mask is not None:
                    context = context[attention_mask[row, start : column + 1].bool()]
                entry["context"] = self._tokens(context.tolist())
                if column + 1 < input_ids.shape[1]:
                    entry["next_token"] = self._tokens([int(input_ids[row, column + 1])])[0]
            named = [("base", components[0]), *zip(self.names, components[1:]), ("composed", composed)]
            if merged is not None:
                named.append(("merged", merged))
            entry["top"] = {name: self._top(tensor[row, column]) for name, tensor in named}
            self.reservoir.store(slot, entry)

    def _tokens(self, ids: list[int]) -> list:
        """Token strings where `decode` is known and gives text, else the ids as "#id"."""
        if self.decode is None:
            return ids
        return [self.decode([token]) or f"#{token}" for token in ids]

    def _top(self, logprobs: torch.Tensor) -> list[list]:
        values, ids = logprobs.float().topk(min(self.settings.top_k, logprobs.shape[-1]))
        return [[self._tokens([token])[0], round(value, 4)] for token, value in zip(ids.tolist(), values.tolist())]

    # ------------------------------------------------------------------------------------------

    def report(self) -> OverlapReport:
        """Reduce the running sums to an `OverlapReport`."""
        settings = self.settings
        n = max(self.positions, 1)
        sequences = max(self.sequences, 1)
        experts = {}
        for index, name in enumerate(self.names):
            mean_abs = self.abs_delta_sum[index] / n  # (V,)
            order = mean_abs.argsort(descending=True)[: settings.top_tokens].tolist()
            experts[name] = {
                "kl_mean": float(self.kl_sum[index]) / n,
                "kl_max": float(self.kl_max[index]),
                "kl_median": min(self.kl_histograms[index].quantile(0.5), float(self.kl_max[index])),
                "active_fraction": float(self.active_count[-1, index]) / n,
                "active_fraction_by_epsilon": {
                    str(e): float(self.active_count[row, index]) / n for row, e in enumerate(settings.epsilons)
                },
                "sequences_active_fraction": float(self.sequences_active[index]) / sequences,
                "interval_length_mean": float(self.interval_length_sum[index]) / max(int(self.sequences_active[index]), 1),
                "projective_error": float(self.restricted_sum[index]) / n,
                "projective_error_max": float(self.restricted_max[index]),
                # The same, only where the expert is active (a_{i,t} > ε): where its skill acts.
                "projective_error_active": (
                    float(self.restricted_active_sum[index]) / int(self.active_count[-1, index])
                    if int(self.active_count[-1, index]) else None
                ),
                "top_tokens": [
                    {
                        "token": self._tokens([token])[0],
                        "mean_abs_delta": float(mean_abs[token]),
                        "support_rate": float(self.support_count[index, token]) / n,
                    }
                    for token in order
                ],
                "kl_histogram": self.kl_histograms[index].to_dict(),
            }
            if self.linearization_positions:
                experts[name]["linearization_error"] = float(self.linearization_sum[index]) / self.linearization_positions
                experts[name]["linearization_error_max"] = float(self.linearization_max[index])
        pairs = {}
        for i, j in self.pairs:
            totals = self.overlap_totals[i, j]
            sums = dx.OverlapSums(*totals.unbind())
            coactive = int(self.pair_coactive[i, j])
            both = int(self.pair_both_active[i, j])
            pairs[pair_key(self.names[i], self.names[j])] = {
                "mass_overlap": float(dx.overlap_ratio(sums)),
                "sign_conflict": float(dx.conflict_ratio(sums)),
                "sign_conflict_overlap": float(dx.overlap_ratio(sums) * dx.conflict_ratio(sums)),
                "support_jaccard": float(self.support_intersection[i, j]) / max(int(self.support_union[i, j]), 1),
                "coactivation_rate": coactive / n,
                "mass_overlap_coactive_mean": float(self.coactive_overlap_sum[i, j]) / coactive if coactive else None,
                "interval_overlap_rate": float(self.pair_intersecting[i, j]) / both if both else None,
                "interval_iou_mean": float(self.pair_iou_sum[i, j]) / both if both else None,
            }
        projective = {
            "single_active": self.single_active_sum / self.single_active_count if self.single_active_count else None,
            "single_active_fraction": self.single_active_count / n,
            "single_active_p95": self.single_active_histogram.quantile(0.95),
            "per_expert": {name: experts[name]["projective_error"] for name in self.names},
        }
        gap = None
        if self.merged_positions:
            gap = {
                "kl_mean": self.gap_sum / self.merged_positions,
                "kl_max": self.gap_max,
                "kl_p95": min(self.gap_histogram.quantile(0.95), self.gap_max),
                "top1_agreement": self.top1_agree / self.merged_positions,
                "histogram": self.gap_histogram.to_dict(),
            }
            if self.residual_positions:
                count = self.residual_positions * self.vocab_size
                gap["interaction_residual_rms"] = math.sqrt(self.residual_square_sum / count)
                gap["interaction_residual_relative"] = (
                    math.sqrt(self.residual_square_sum / self.signal_square_sum) if self.signal_square_sum > 0 else None
                )
        epsilons = [*settings.epsilons]
        return OverlapReport(
            num_positions=self.positions,
            num_sequences=self.sequences,
            settings=settings.model_dump(),
            coactivation_rate=float(self.coactive_count[-1]) / n,
            coactivation_by_epsilon={str(e): float(self.coactive_count[row]) / n for row, e in enumerate(epsilons)},
            active_count_distribution=(self.active_set_sizes.double() / n).tolist(),
            experts=experts,
            pairs=pairs,
            projective_error=projective,
            merge_compose_gap=gap,
            heatmap=self.heatmap,
            reservoir=self.reservoir.samples(),
        )
