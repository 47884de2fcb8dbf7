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

Each uses only the public pure functions of `mergecompose.analysis.diagnostics`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from mergecompose.analysis import diagnostics as dx
from mergecompose.composition.rule import LOGPROB_FLOOR


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
      (`mergecompose.analysis.diagnostics.centred_deltas`): "base_weighted_median" (the default: set by where
      the base's mass is, and cheap to find on the top-k union) or "median" (each token counted
      once; a selection over V per position);
    * `full_vocabulary`: compute the centre, supports, overlap sums, top tokens and restricted
      projective error over all V tokens at every position. By default (False) they are computed
      on the `candidates` tokens U with the largest max(p_b, p_i…, q) at each position (the union
      of each one's top tokens), and the report gives the mass outside U (`vocabulary`) and
      bounds on each pair's mass overlap;
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
    centre: Literal["median", "base_weighted_median"] = "base_weighted_median"
    full_vocabulary: bool = False
    candidates: int = Field(256, ge=1)
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
        self.edges = torch.logspace(
            math.log10(low), math.log10(high), round(decades * bins_per_decade) + 1, dtype=torch.float64
        )
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
# One set of positions, computed once


@dataclass
class MeasuredBatch:
    """What the position reducers read from a set of n measured positions, computed once.

    Per-position statistics that are one sum over the vocabulary (the KLs, the interaction
    residual) are always computed over all V tokens. The statistics that look at single tokens
    (centre, supports, overlap sums, top tokens, restricted projective error) are computed on
    M *measured columns*: all V (`settings.full_vocabulary`), or per position the
    `settings.candidates` tokens U with the largest max(p_b, p_i…, q) (`columns`), where the
    mass each distribution puts outside U is kept in `outside_mass`.

    On all V, log-probs are re-normalised in float32 (`log_softmax`); on U they are used as
    given (normalised, checked). Probabilities are their `exp`.
    """

    base: torch.Tensor  # (n, M) log p_b on the measured columns
    experts: torch.Tensor  # (k, n, M) log p_i
    composed: torch.Tensor  # (n, M) log q
    base_probs: torch.Tensor  # (n, M)
    expert_probs: torch.Tensor  # (k, n, M)
    composed_probs: torch.Tensor  # (n, M)
    activity: torch.Tensor  # (k, n) a_i = KL(p_i ‖ p_b), over V
    active: torch.Tensor  # (k, n) bool, a_i > settings.epsilon
    single_active: torch.Tensor  # (n,) KL(p_active ‖ q) over V, 0 where not eligible
    single_eligible: torch.Tensor  # (n,) bool, |A_t| ≤ 1
    centred: torch.Tensor  # (k, n, M) centred deltas δ̃_i
    supports: torch.Tensor  # (k, n, M) bool supports S_i
    columns: torch.Tensor | None  # (n, M) token ids of the measured columns; None = all V in order
    outside_mass: torch.Tensor | None  # (k+2, n) mass of p_b, p_i…, q outside U
    # An interval [c − below, c + above] around the centre c on U that also holds the centre over V; inf if unbounded.
    centre_below: torch.Tensor | None  # (k, n)
    centre_above: torch.Tensor | None  # (k, n)
    delta_extent: torch.Tensor | None  # (k, n) max over V ∖ U of |δ_i − c| for c in that interval
    merge_gap: torch.Tensor | None  # (n,) KL(q ‖ m) over V
    top1_agree: torch.Tensor | None  # (n,) bool
    residual_square: torch.Tensor | None  # (n,) Σ_v r² of the interaction residual
    signal_square: torch.Tensor | None  # (n,) Σ_v of the squared centred composed logit change
    linearization: torch.Tensor | None  # (k, n) linearization error of θ_b + λτ_i

    @property
    def num_positions(self) -> int:
        return self.base.shape[0]

    @classmethod
    def measure(
        cls,
        components: torch.Tensor,
        composed: torch.Tensor,
        merged: torch.Tensor | None,
        scaled_experts: torch.Tensor | None,
        weights: list[float],
        settings: OverlapSettings,
        pass_positions: int | None = None,
    ) -> MeasuredBatch:
        """Measure n positions: `components` `(k+1, n, V)`, `composed` and `merged` `(n, V)`,
        `scaled_experts` `(k, n, V)`, log-probs in any float dtype.

        The passes over V run on `pass_positions` positions at a time (default: `compile_rows(V)`
        from `COMPILE_MIN_VOCAB` tokens on, else about 2^18 values per tensor), so that their
        temporaries stay in cache instead of making several trips through memory per statistic.
        """
        n, V = composed.shape
        step = pass_positions or (compile_rows(V) if V >= COMPILE_MIN_VOCAB else max(1, 2**18 // V))
        parts = [
            _measure_rows(
                components[:, start : start + step],
                composed[start : start + step],
                None if merged is None else merged[start : start + step],
                None if scaled_experts is None else scaled_experts[:, start : start + step],
                weights,
                settings,
            )
            for start in range(0, n, step)
        ]
        fields = {}
        for name in parts[0]:
            values = [part[name] for part in parts]
            fields[name] = None if values[0] is None else torch.cat(values, dim=_POSITION_DIM.get(name, 0))
        if not settings.full_vocabulary:
            # The work on U's columns, once for all n positions: a few large operations, not many small ones.
            fields = _union_columns(fields, settings)
        return cls(**fields)


@dataclass
class SequenceBatch:
    """What the per-sequence reducers (intervals, examples) read from one batch as given."""

    mask: torch.Tensor  # (B, T) bool, the measured positions
    activity_grid: torch.Tensor  # (k, B, T), 0 where not measured
    intervals: torch.Tensor  # (k, B, 2) active intervals [τ1, τ2); (-1, -1) where never active
    components: torch.Tensor  # (k+1, B, T, V)
    composed_grid: torch.Tensor  # (B, T, V)
    merged_grid: torch.Tensor | None  # (B, T, V)
    input_ids: torch.Tensor | None  # (B, T)
    attention_mask: torch.Tensor | None  # (B, T)


# Fields whose positions are on dim 1 (a leading k or k+2 axis); the rest have them on dim 0.
_POSITION_DIM = {
    "experts": 1,
    "expert_probs": 1,
    "activity": 1,
    "active": 1,
    "centred": 1,
    "supports": 1,
    "outside_mass": 1,
    "centre_below": 1,
    "centre_above": 1,
    "delta_extent": 1,
    "linearization": 1,
    "gathered": 1,
    "delta_low": 1,
    "delta_high": 1,
    "tail_low": 1,
    "tail_high": 1,
}


def _measure_rows(components, composed, merged, scaled_experts, weights, settings: OverlapSettings) -> dict:
    """`MeasuredBatch`'s fields for a few positions; see `MeasuredBatch.measure` for the shapes."""
    if not settings.full_vocabulary:
        return _union_rows(components, composed, merged, scaled_experts, weights, settings)
    normalised = torch.log_softmax(components.float(), dim=-1)  # (k+1, n, V)
    base, experts = normalised[0], normalised[1:]  # (n, V), (k, n, V)
    log_q = torch.log_softmax(composed.float(), dim=-1)  # (n, V)
    expert_probs = experts.exp()
    activity = dx.kl_from_logprobs(experts, expert_probs, base)  # (k, n)
    active = dx.active_experts(activity, settings.epsilon)
    single, eligible = dx.single_active_error_from_logprobs(base, experts, log_q, active)
    base_probs, composed_probs = base.exp(), log_q.exp()
    centred = dx.centred_deltas_from_logprobs(base, experts, centre=settings.centre, base_probs=base_probs)
    fields = dict(
        activity=activity,
        active=active,
        single_active=single,
        single_eligible=eligible,
        base=base,
        experts=experts,
        composed=log_q,
        base_probs=base_probs,
        expert_probs=expert_probs,
        composed_probs=composed_probs,
        centred=centred,
        columns=None,
        outside_mass=None,
        centre_below=None,
        centre_above=None,
        delta_extent=None,
        supports=dx.delta_supports_from_probs(centred, base_probs, expert_probs, settings.epsilon, settings.eta),
    )
    fields.update(_merge_measures(base, experts, log_q, merged, scaled_experts, weights))
    return fields


def _merge_measures(base, experts, log_q, merged, scaled_experts, weights) -> dict:
    """Per position over V: KL(q ‖ m), top-1 agreement, the interaction residual's sums, the linearization errors."""
    fields = dict(merge_gap=None, top1_agree=None, residual_square=None, signal_square=None, linearization=None)
    scaled = None if scaled_experts is None else scaled_experts.float()  # (k, n, V), as given
    if scaled is not None and any(w != 1.0 for w in weights):  # at λ = 1 it is 0 by construction
        fields["linearization"] = torch.stack(
            [dx.linearization_error(scaled[i], base, experts[i], lam) for i, lam in enumerate(weights)]
        )  # (k, n)
    if merged is None:
        return fields
    log_m = torch.log_softmax(merged.float(), dim=-1)  # (n, V)
    fields["merge_gap"] = dx.kl_from_logprobs(log_q, log_q.exp(), log_m)
    fields["top1_agree"] = dx.top1_agreement(log_q, log_m)
    if scaled is None:
        return fields
    residual = dx.interaction_residual(log_m, scaled, base)  # (n, V)
    lam = torch.tensor(weights, device=base.device)[:, None, None]
    signal = dx.centre((lam * (experts - base)).sum(0))  # (n, V): the composed logit change
    fields["residual_square"] = residual.double().square().sum(-1)
    fields["signal_square"] = signal.double().square().sum(-1)
    return fields


def vocabulary_sums(components: torch.Tensor, log_q: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Everything the top-k union path needs from all V tokens, from one read of the log-probs.

    Args:
        components: `(k+1, n, V)` float32 normalised log-probs ℓ_c, base first; log_q: `(n, V)`.

    Returns:
        `kl_base` `(k, n)` = Σ_v p_i (ℓ_i − b) = KL(p_i ‖ p_b); `self_information` `(k+1, n)` =
        Σ_v p_c ℓ_c; `cross_composed` `(k+1, n)` = Σ_v p_c log q; `mass` `(k+1, n)` = Σ_v p_c;
        `delta_low`, `delta_high` `(k, n)`, the least and largest δ_i over V; `peak` `(n, V)` =
        max(ℓ_b, ℓ_1…, log q), the largest log-prob any of them gives each token. 0·log 0 = 0.
    """
    probs = components.exp()  # (k+1, n, V)
    present = probs > 0
    base = components[0]
    kl_base = torch.where(present[1:], probs[1:] * (components[1:] - base), 0.0).sum(-1)
    self_information = torch.where(present, probs * components, 0.0).sum(-1)
    cross_composed = torch.where(present, probs * log_q, 0.0).sum(-1)
    deltas = components[1:].clamp(min=LOGPROB_FLOOR) - base.clamp(min=LOGPROB_FLOOR)  # (k, n, V)
    peak = torch.maximum(components.amax(0), log_q)
    return kl_base, self_information, cross_composed, probs.sum(-1), deltas.amin(-1), deltas.amax(-1), peak


def tail_delta_range(
    components: torch.Tensor, peak: torch.Tensor, threshold: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The least and largest δ_i over the tokens outside U, from a second read of the log-probs.

    Args:
        components: `(k+1, n, V)` log-probs; peak: `(n, V)` from `vocabulary_sums`; threshold:
            `(n,)` the least peak in U. Tokens with `peak ≤ threshold` count as outside (a superset
            of V ∖ U where peaks tie, so the range is still a bound).

    Returns:
        `(low, high)`, each `(k, n)`; `(+inf, −inf)` where no token is outside.
    """
    deltas = components[1:].clamp(min=LOGPROB_FLOOR) - components[0].clamp(min=LOGPROB_FLOOR)  # (k, n, V)
    outside = peak <= threshold[:, None]  # (n, V)
    return torch.where(outside, deltas, float("inf")).amin(-1), torch.where(outside, deltas, float("-inf")).amax(-1)


# The two passes compiled: one loop over V each instead of about twenty (measured 6x on the CPU at
# V = 32,000). Used from `COMPILE_MIN_VOCAB` tokens on, where the one-off compilation (tens of
# seconds, once per process and shape) pays; the rows are padded to `compile_rows(V)` (about 2^21
# values per tensor: fewer rows ran up to 4x slower per value at V = 8,192) so that one shape
# serves every chunk. Without a working compiler they fall back to eager, once, with a warning.
COMPILE_MIN_VOCAB = 4096


def compile_rows(V: int) -> int:
    return max(1, min(1024, 2**21 // V))


_compiled: dict = {"failed": False}


def _pass(function, n: int, V: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`function(*tensors)`, compiled where it pays; every input and output has its n rows on dim −2
    (`(…, n, V)` inputs, `(…, n)` outputs), or on dim −1 for `(n,)` inputs."""
    if V < COMPILE_MIN_VOCAB or _compiled["failed"] or not hasattr(torch, "compile"):
        return function(*tensors)
    if function.__name__ not in _compiled:
        _compiled[function.__name__] = torch.compile(function, dynamic=False)
    padding = compile_rows(V) - n
    if padding > 0:
        tensors = tuple(
            torch.nn.functional.pad(t, (0, padding) if t.dim() == 1 else (0, 0, 0, padding)) for t in tensors
        )
    try:
        results = _compiled[function.__name__](*tensors)
    except Exception as error:  # noqa: BLE001 - any compiler failure: the eager function gives the same values
        _compiled["failed"] = True
        warnings.warn(
            f"torch.compile of the overlap's vocabulary pass failed ({type(error).__name__}); running it eagerly",
            stacklevel=2,
        )
        return function(*(t[..., :n] if t.dim() == 1 else t[..., :n, :] for t in tensors))
    return tuple(
        result[..., :n, :] if result.shape[-1] == V and result.dim() == 2 else result[..., :n] for result in results
    )


def _union_rows(components, composed, merged, scaled_experts, weights, settings: OverlapSettings) -> dict:
    """The top-k union path: sums over V from one read (`vocabulary_sums`), token statistics on U.

    U is, per position, the `settings.candidates` tokens with the largest max(p_b, p_i…, q). The
    log-probs are used as given (they must be normalised; checked). The centre is taken over U
    (`mergecompose.analysis.diagnostics.union_centre`); for the base-weighted median the interval it returns
    also holds the centre over all V, which bounds what the restriction changes (`mass_overlap_bounds`).
    """
    components, log_q = components.float(), composed.float()  # (k+1, n, V), (n, V)
    k, V = components.shape[0] - 1, components.shape[-1]
    n = log_q.shape[0]
    kl_base, self_information, cross_composed, mass, delta_low, delta_high, peak = _pass(
        vocabulary_sums, n, V, components, log_q
    )
    worst = float((mass - 1).abs().max())
    if not worst <= 1e-3:
        raise ValueError(
            f"`components` must be normalised log-probs (each position's probabilities summing to 1); a sum is off by {worst:.3g}. "
            "Pass log_softmax of the logits, as ComposedLM.component_logprobs gives"
        )
    activity = kl_base.clamp(min=0)  # (k, n)
    active = dx.active_experts(activity, settings.epsilon)
    # KL(p_ref ‖ q), p_ref the one active expert or else the base (`single_active_error_from_logprobs`).
    eligible = active.sum(0) <= 1  # (n,)
    choice = torch.where(active.any(0), active.float().argmax(0) + 1, 0)  # (n,)
    single = (self_information - cross_composed).gather(0, choice[None])[0].clamp(min=0)
    fields = dict(
        activity=activity,
        active=active,
        single_active=torch.where(eligible, single, 0.0),
        single_eligible=eligible,
    )
    fields.update(_merge_measures(components[0], components[1:], log_q, merged, scaled_experts, weights))

    top = peak.topk(min(settings.candidates, V), dim=-1, sorted=False)
    columns = top.indices.sort(dim=-1).values  # (n, M)
    tail_low, tail_high = _pass(tail_delta_range, n, V, components, peak, top.values.amin(-1))  # (k, n) each
    gathered = torch.cat(
        [components.gather(-1, columns.expand(k + 1, *columns.shape)), log_q.gather(-1, columns)[None]]
    )
    fields.update(
        columns=columns,
        gathered=gathered,
        delta_low=delta_low,
        delta_high=delta_high,
        tail_low=tail_low,
        tail_high=tail_high,
    )
    return fields


def _union_columns(fields: dict, settings: OverlapSettings) -> dict:
    """`_union_rows`'s gathered columns `(k+2, n, M)` -> centre, supports, probabilities, bounds' inputs."""
    gathered, columns = fields.pop("gathered"), fields["columns"]
    delta_low, delta_high = fields.pop("delta_low"), fields.pop("delta_high")
    tail_low, tail_high = fields.pop("tail_low"), fields.pop("tail_high")
    k = gathered.shape[0] - 2
    probs = gathered.exp()  # (k+2, n, M)
    outside_mass = (1 - probs.sum(-1)).clamp(min=0)  # (k+2, n)
    base, experts = gathered[0], gathered[1 : k + 1]
    deltas = experts.clamp(min=LOGPROB_FLOOR) - base.clamp(min=LOGPROB_FLOOR)  # (k, n, M)
    bounded = settings.centre == "base_weighted_median"
    centre_weights = probs[0] if bounded else torch.ones_like(probs[0])
    centre, lower, upper = dx.union_centre(
        deltas,
        centre_weights.expand_as(deltas),
        outside_mass[0].expand(k, -1),
        (delta_low, delta_high),
        bounded=bounded,
    )  # each (k, n, 1)
    centred = deltas - centre
    fields.update(
        base=base,
        experts=experts,
        composed=gathered[k + 1],
        base_probs=probs[0],
        expert_probs=probs[1 : k + 1],
        composed_probs=probs[k + 1],
        centred=centred,
        columns=columns,
        outside_mass=outside_mass,
        centre_below=(centre - lower)[..., 0],
        centre_above=(upper - centre)[..., 0],
        # Outside U, |δ_i − c| ≤ this for every c in the centre's interval; 0 where nothing is outside.
        delta_extent=torch.maximum(tail_high - lower[..., 0], upper[..., 0] - tail_low).clamp(min=0),  # (k, n)
        supports=dx.delta_supports_from_probs(centred, probs[0], probs[1 : k + 1], settings.epsilon, settings.eta),
    )
    return fields


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
            "coactivation_by_epsilon": {
                str(e): float(self.coactive_count[row]) / n for row, e in enumerate(self.epsilons)
            },
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

    def update(self, batch: SequenceBatch) -> None:
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
                "interval_length_mean": float(self.interval_length_sum[index])
                / max(int(self.sequences_active[index]), 1),
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
        # On the top-k union: lower and upper bounds on the full `product`, `square_i`, `square_j`.
        self.restricted = False
        self.bound_totals = torch.zeros(len(self.pairs), 3, 2, dtype=torch.float64)

    def update(self, batch: MeasuredBatch) -> None:
        self.positions += batch.num_positions
        centred, supports = batch.centred, batch.supports  # (k, N, M), (k, N, M)
        for pair, (i, j) in enumerate(self.pairs):
            weight = dx.overlap_weights_from_probs(
                batch.base_probs, batch.expert_probs[i], batch.expert_probs[j], batch.composed_probs
            )  # (N, M)
            sums = dx.overlap_sums(centred[i], centred[j], weight)  # each (N,)
            self.overlap_totals[pair] += torch.stack([s.double().sum() for s in sums]).cpu()
            if batch.columns is not None:
                self.restricted = True
                self.bound_totals[pair] += self._sum_bounds(batch, weight, i, j)
            both = batch.active[i] & batch.active[j]  # (N,)
            self.coactive[pair] += int(both.sum())
            self.coactive_overlap_sum[pair] += float(dx.overlap_ratio(sums)[both].double().sum())
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
        """`{"a|b": stats}`; on the top-k union also `mass_overlap_bounds`, `[low, high]` for the full computation."""
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
            if self.restricted:
                pairs[pair_key(self.names[i], self.names[j])]["mass_overlap_bounds"] = self._bounds(pair)
        return pairs


class TopTokenReducer:
    """Per expert, the tokens with the largest mean |δ̃_i| and how often each is in the support S_i. O(k·V).

    On the top-k union a token's |δ̃_i| counts only at the positions where it is in U (0 elsewhere)."""

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
    `KL(p_i(·|S_i ∪ B) ‖ q(·|S_i ∪ B))`, over all positions and where the expert is active
    (on the top-k union: S_i ∪ B within U)."""

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
        single, eligible = batch.single_active, batch.single_eligible  # (N,), over V
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
                    if int(self.active_count[index])
                    else None
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
    (`mergecompose.analysis.diagnostics.interaction_residual`) against the composed logit change `Σ λ_i δ_i`."""

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
    """Per expert, the linearization error of `θ_b + λτ_i` (`mergecompose.analysis.diagnostics.linearization_error`);
    measured only when some λ ≠ 1 (at λ = 1 it is 0 by construction)."""

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

    def update(self, batch: SequenceBatch) -> None:
        rows = batch.mask.any(-1).nonzero().flatten().tolist()
        first_sequence = self.sequences
        self.sequences += len(rows)
        self._update_heatmap(batch, rows, first_sequence)
        self._update_reservoir(batch, rows, first_sequence)

    def _update_heatmap(self, batch: SequenceBatch, rows: list[int], first_sequence: int) -> None:
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
                next_tokens = [
                    None if t < 0 else token_labels([t], self.decode)[0] for t in padded[columns + 1].tolist()
                ]
            self.heatmap.append(
                {
                    "sequence": first_sequence + offset,
                    "activity": batch.activity_grid[:, row, columns].cpu().tolist(),  # (k, n_row)
                    "next_tokens": next_tokens,
                    "intervals": row_intervals,
                }
            )

    def _update_reservoir(self, batch: SequenceBatch, rows: list[int], first_sequence: int) -> None:
        input_ids, attention_mask = batch.input_ids, batch.attention_mask
        named = [
            ("base", batch.components[0]),
            *zip(self.names, batch.components[1:]),
            ("composed", batch.composed_grid),
        ]
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


class VocabularyReducer:
    """On the top-k union U: per distribution (base, each expert, composed) the mean and largest
    probability mass outside U; nothing when the full vocabulary is measured."""

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

    def report(self) -> dict | None:
        """The report's `vocabulary` section; None when the full vocabulary was measured."""
        if not self.positions:
            return None
        return {
            "measured": "top_k_union",
            "candidates": self.candidates,
            "outside_mass_mean": {
                label: float(self.outside_sum[i]) / self.positions for i, label in enumerate(self.labels)
            },
            "outside_mass_max": {label: float(self.outside_max[i]) for i, label in enumerate(self.labels)},
        }
