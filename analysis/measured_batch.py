"""What the reducers read: `MeasuredBatch` (a set of measured positions) and `SequenceBatch` (whole sequences).

`MeasuredBatch.measure` is the measurement kernel: from the log-probs of n positions it computes,
once, everything the position reducers need (normalised log-probs, activity, centred deltas,
supports, the merge's gap). On the top-k union (the default) the sums over the vocabulary come
from one read of the log-probs (`vocabulary_sums`), compiled with `torch.compile` where that pays,
and the centre is taken over the union with an interval that also holds the one over all V
(`union_centre`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from mergecompose.analysis import delta_overlap as ox
from mergecompose.analysis import diagnostics as dx
from mergecompose.analysis.overlap_settings import OverlapSettings
from mergecompose.composition.rule import LOGPROB_FLOOR


@dataclass
class MeasuredBatch:
    """What the position reducers read from a set of n measured positions, computed once.

    Per-position statistics that are one sum over the vocabulary (the KLs, the interaction
    residual) and the top-1 tokens are always computed over all V tokens. The statistics that look at single tokens
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
    top1: torch.Tensor  # (k+1, n) int64 argmax over V of b, ℓ_1…ℓ_k (`shift_diagnostics.top1_tokens`)
    expert_composed_kl: torch.Tensor  # (k, n) KL(p_i ‖ q) over V
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
    # Retention (`mergecompose.analysis.retention`), over V: which of merge and composition keeps each expert's top-1.
    composed_top1: torch.Tensor | None = None  # (n,) int64 argmax of q
    base_expert_logprob: torch.Tensor | None = None  # (k, n) log p_b(t_i), t_i expert i's top-1 token
    merged_top1: torch.Tensor | None = None  # (n,) int64 argmax of m
    expert_merged_kl: torch.Tensor | None = None  # (k, n) KL(p_i ‖ m)

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
    "top1": 1,
    "expert_composed_kl": 1,
    "base_expert_logprob": 1,
    "expert_merged_kl": 1,
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
    top1, expert_composed_kl = normalised.argmax(-1), dx.kl_from_logprobs(experts, expert_probs, log_q)
    centred = ox.centred_deltas_from_logprobs(base, experts, centre=settings.centre, base_probs=base_probs)
    fields = dict(
        activity=activity,
        active=active,
        single_active=single,
        single_eligible=eligible,
        top1=top1,
        expert_composed_kl=expert_composed_kl,
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
        supports=ox.delta_supports_from_probs(centred, base_probs, expert_probs, settings.epsilon, settings.eta),
    )
    fields.update(_merge_measures(base, experts, log_q, merged, scaled_experts, weights, top1))
    return fields


def _merge_measures(base, experts, log_q, merged, scaled_experts, weights, top1) -> dict:
    """Per position over V: KL(q ‖ m), top-1 agreement, the interaction residual's sums, the linearization errors;
    what retention reads: q's and m's top-1 tokens, KL(p_i ‖ m), log p_b(t_i) (`top1` `(k+1, n)`: t_b, t_1…t_k)."""
    fields = dict(merge_gap=None, top1_agree=None, residual_square=None, signal_square=None, linearization=None)
    fields.update(
        composed_top1=log_q.argmax(-1),
        base_expert_logprob=base.gather(-1, top1[1:].T).T,  # (k, n)
        merged_top1=None,
        expert_merged_kl=None,
    )
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
    fields["merged_top1"] = log_m.argmax(-1)
    fields["expert_merged_kl"] = dx.kl_from_logprobs(experts, experts.exp(), log_m)  # (k, n)
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
        max(ℓ_b, ℓ_1…, log q), the largest log-prob any of them gives each token; `top1` `(k+1, n)` int64,
        argmax_v ℓ_c (the first of tied maxima). 0·log 0 = 0.
    """
    probs = components.exp()  # (k+1, n, V)
    present = probs > 0
    base = components[0]
    kl_base = torch.where(present[1:], probs[1:] * (components[1:] - base), 0.0).sum(-1)
    self_information = torch.where(present, probs * components, 0.0).sum(-1)
    cross_composed = torch.where(present, probs * log_q, 0.0).sum(-1)
    deltas = components[1:].clamp(min=LOGPROB_FLOOR) - base.clamp(min=LOGPROB_FLOOR)  # (k, n, V)
    peak = torch.maximum(components.amax(0), log_q)
    top1 = components.argmax(-1)  # (k+1, n)
    return kl_base, self_information, cross_composed, probs.sum(-1), deltas.amin(-1), deltas.amax(-1), peak, top1


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


# The two passes compiled: one loop over V each instead of about twenty. Used from `COMPILE_MIN_VOCAB`
# tokens on, where the one-off compilation (once per process and shape) pays for itself; the rows are
# padded to `compile_rows(V)` (about 2^21 values per tensor; fewer rows per call are slower per value)
# so that one shape serves every chunk. Without a working compiler they fall back to eager, once, with
# a warning.
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


def union_centre(
    deltas: torch.Tensor,
    weights: torch.Tensor,
    outside_mass: torch.Tensor,
    delta_range: tuple[torch.Tensor, torch.Tensor],
    bounded: bool = True,
    slack: float = 1e-4,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The centre of δ over a token subset U, and an interval `[lower, upper]` that holds it and the centre over all V.

    `centre = weighted_median(δ_U, weights)` (`delta_overlap.weighted_median`, the lower one, over U). With
    `weights = p_b` on U, the base-weighted median over all V is the smallest δ(v) with
    `F(δ(v)) ≥ ½`, `F(t) = Σ_{v: δ(v) ≤ t} p_b(v)`. Over U, `F_U ≤ F ≤ F_U + τ` with τ the
    base's mass outside U, so it lies in
    `[max{δ_u : F_U(δ_u) < ½ − τ}, min{δ_u : F_U(δ_u) ≥ ½}]` (`slack` widens both sides against
    float32 rounding of the cumulative sums), and so does the centre over U. Where no δ_u
    qualifies, the interval extends to the minimum or maximum of δ over all V (`delta_range`).

    Args:
        deltas: `(..., M)` δ on U; weights: `(..., M)` non-negative (0 on duplicate columns);
        outside_mass: `(...)` τ; delta_range: `(min_V δ, max_V δ)`, each `(...)`;
        bounded: False for weights that are not p_b (e.g. counts for the plain median): the
            interval is then `(−inf, inf)`.

    Returns:
        `(centre, lower, upper)`, each `(..., 1)`.
    """
    ordered, order = deltas.sort(dim=-1)
    cumulative = weights.gather(-1, order).cumsum(-1)  # (..., M)
    last = deltas.shape[-1] - 1
    centre = ordered.gather(-1, (cumulative < 0.5 * cumulative[..., -1:]).sum(-1, keepdim=True).clamp(max=last))
    if not bounded:
        infinite = torch.full_like(centre, float("inf"))
        return centre, -infinite, infinite
    below = (cumulative < 0.5 - outside_mass[..., None] - slack).sum(-1, keepdim=True)  # (..., 1)
    lower = torch.where(below > 0, ordered.gather(-1, (below - 1).clamp(min=0)), delta_range[0][..., None])
    reached = (cumulative < 0.5 + slack).sum(-1, keepdim=True)
    upper = torch.where(reached <= last, ordered.gather(-1, reached.clamp(max=last)), delta_range[1][..., None])
    return centre, lower, upper


def _union_rows(components, composed, merged, scaled_experts, weights, settings: OverlapSettings) -> dict:
    """The top-k union path: sums over V from one read (`vocabulary_sums`), token statistics on U.

    U is, per position, the `settings.candidates` tokens with the largest max(p_b, p_i…, q). The
    log-probs are used as given (they must be normalised; checked). The centre is taken over U
    (`union_centre`); for the base-weighted median the interval it returns also holds the centre
    over all V, which bounds what the restriction changes (`mass_overlap_bounds`).
    """
    components, log_q = components.float(), composed.float()  # (k+1, n, V), (n, V)
    k, V = components.shape[0] - 1, components.shape[-1]
    n = log_q.shape[0]
    kl_base, self_information, cross_composed, mass, delta_low, delta_high, peak, top1 = _pass(
        vocabulary_sums, n, V, components, log_q
    )
    worst = float((mass - 1).abs().max())
    if not worst <= 1e-3:
        raise ValueError(
            "`components` must be normalised log-probs (each position's probabilities summing to 1); "
            f"a sum is off by {worst:.3g}. Pass log_softmax of the logits, as ComposedLM.component_logprobs gives"
        )
    activity = kl_base.clamp(min=0)  # (k, n)
    active = dx.active_experts(activity, settings.epsilon)
    # KL(p_ref ‖ q), p_ref the one active expert or else the base (`single_active_error_from_logprobs`).
    eligible = active.sum(0) <= 1  # (n,)
    choice = torch.where(active.any(0), active.float().argmax(0) + 1, 0)  # (n,)
    composed_kl = (self_information - cross_composed).clamp(min=0)  # (k+1, n): KL(p_c ‖ q)
    single = composed_kl.gather(0, choice[None])[0]
    fields = dict(
        activity=activity,
        active=active,
        single_active=torch.where(eligible, single, 0.0),
        single_eligible=eligible,
        top1=top1,
        expert_composed_kl=composed_kl[1:],
    )
    fields.update(_merge_measures(components[0], components[1:], log_q, merged, scaled_experts, weights, top1))

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
    centre, lower, upper = union_centre(
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
        supports=ox.delta_supports_from_probs(centred, probs[0], probs[1 : k + 1], settings.epsilon, settings.eta),
    )
    return fields
