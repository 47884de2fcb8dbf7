"""Where two experts' log-probability deltas overlap over the vocabulary, as pure functions on tensors.

The deltas `δ_i = ℓ_i − b` centred over the vocabulary (`centred_deltas`), their supports (`delta_supports`),
the overlap weight `w = max(p_b, p_i, p_j, q)` (`overlap_weights`), and from the weighted sums `OverlapSums` the
mass overlap `O_ij` (`weighted_overlap`), its sign-conflict share (`sign_conflict_mass`) and the ratio of the two
deltas' norms (`delta_norm_ratio`). Notation and conventions as in diagnostics.py: logits or log-probs on the last
axis, normalised here with `log_softmax` in float32; each `*_from_*` kernel takes inputs already normalised, for
the streaming accumulator. Nothing here looks at a model, a file or global state.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mergecompose.analysis.diagnostics import Experts, _logprobs, _stack
from mergecompose.composition.rule import LOGPROB_FLOOR

CENTRES = ("median", "base_weighted_median")


def centred_deltas(
    base: torch.Tensor, experts: Experts, floor: float = LOGPROB_FLOOR, centre: str = "median"
) -> torch.Tensor:
    """`δ̃_i = δ_i − c_i`, with `δ_i = log p_i − log p_b` and `c_i` a centre of δ_i over the vocabulary.

    Composition is shift-invariant (a constant added to `δ_i` cancels in the normalisation), so
    only the deviation from a typical token matters. Two centres:

    * `"median"` (the default of this function): `c_i = median_v δ_i`, each token counted
      once. An expert that moves a few tokens and rescales the rest leaves most tokens at one
      constant offset, which the median removes exactly while the mean would not. With V even,
      the lower median is taken (`torch.median`).
    * `"base_weighted_median"`: `c_i` = the smallest δ_i(v) with `Σ_{u: δ_i(u) ≤ δ_i(v)} p_b(u) ≥ 1/2`,
      the median under the base's probabilities (`weighted_median`). When the base is peaked,
      the plain median is set by tokens that carry no mass, whose log-probs drift freely in
      fine-tuning; this centre is set by where the base's mass is, and still removes the
      background's constant offset exactly when the base puts more than half its mass there.

    `-inf` log-probs are clamped to `floor` first.

    Returns:
        `(k, ..., V)` float32.
    """
    base_logprobs = _logprobs(base)
    return centred_deltas_from_logprobs(base_logprobs, _stack(experts, base), floor, centre, base_logprobs.exp())


def weighted_median(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted median over the last axis: the smallest value whose cumulative weight reaches half.

    `m = min{values[v] : Σ_{u: values[u] ≤ values[v]} weights[u] ≥ ½ Σ_u weights[u]}` (the lower
    weighted median; with equal weights and odd V it is the median).

    Args:
        values: `(..., V)`; weights: non-negative, broadcastable to `values`.

    Returns:
        `(..., 1)`.
    """
    ordered, order = values.sort(dim=-1)
    cumulative = weights.expand_as(values).gather(-1, order).cumsum(-1)  # (..., V)
    index = (cumulative < 0.5 * cumulative[..., -1:]).sum(-1, keepdim=True).clamp(max=values.shape[-1] - 1)
    return ordered.gather(-1, index)


def centred_deltas_from_logprobs(
    base: torch.Tensor,
    experts: torch.Tensor,
    floor: float = LOGPROB_FLOOR,
    centre: str = "median",
    base_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """`δ̃_i = δ_i − c_i`, `δ_i = max(ℓ_i, floor) − max(b, floor)`, from normalised log-probs.

    The kernel of `centred_deltas` (which see for the two centres `c_i`), without normalising.

    Args:
        base: `(..., V)` normalised log-probs `b`, e.g. `(batch, seq, vocab)`;
        experts: `(k, ..., V)` normalised log-probs `ℓ_i`;
        base_probs: `exp(base)`, `(..., V)`, used by `"base_weighted_median"` (computed if omitted).

    Returns:
        `(k, ..., V)`.
    """
    deltas = experts.clamp(min=floor) - base.clamp(min=floor)  # (k, ..., V)
    if centre == "median":
        return deltas - deltas.median(dim=-1, keepdim=True).values
    if centre == "base_weighted_median":
        return deltas - weighted_median(deltas, base.exp() if base_probs is None else base_probs)
    raise ValueError(f"`centre` must be one of {list(CENTRES)}, got {centre!r}")


def delta_supports(
    centred: torch.Tensor, base: torch.Tensor, experts: Experts, epsilon: float, eta: float
) -> torch.Tensor:
    """Supports `S_i = {v : |δ̃_i(v)| > ε and max(p_b(v), p_i(v)) > η}`.

    The probability floor η keeps tokens that neither model would ever emit out of the
    support: their log-ratio can be large while carrying no mass.

    Args:
        centred: `(k, ..., V)` from `centred_deltas`; base `(..., V)`; experts `(k, ..., V)`.

    Returns:
        `(k, ..., V)` bool.
    """
    if not epsilon >= 0:
        raise ValueError(f"`epsilon` must be >= 0, got {epsilon}")
    if not 0 <= eta < 1:
        raise ValueError(f"`eta` must be in [0, 1), got {eta}")
    return delta_supports_from_probs(centred, _logprobs(base).exp(), _stack(experts, base).exp(), epsilon, eta)


def delta_supports_from_probs(
    centred: torch.Tensor, base_probs: torch.Tensor, expert_probs: torch.Tensor, epsilon: float, eta: float
) -> torch.Tensor:
    """`S_i = {v : |δ̃_i(v)| > ε and max(p_b(v), p_i(v)) > η}` from probabilities, unchecked.

    The kernel of `delta_supports`, which validates ε and η and normalises its inputs.

    Args:
        centred: `(k, ..., V)` centred deltas δ̃_i, e.g. `(k, batch, seq, vocab)`;
        base_probs: `(..., V)` p_b; expert_probs: `(k, ..., V)` p_i.

    Returns:
        `(k, ..., V)` bool.
    """
    return (centred.abs() > epsilon) & (torch.maximum(expert_probs, base_probs) > eta)


def overlap_weights(
    base: torch.Tensor, expert_i: torch.Tensor, expert_j: torch.Tensor, composed: torch.Tensor
) -> torch.Tensor:
    """The overlap weight `w = max(p_b, p_i, p_j, q)` per token: `(..., V)` float32.

    A token counts in proportion to the largest probability any of the four distributions
    gives it, so tokens that no model would emit do not dominate the overlap.
    """
    probabilities = [_logprobs(t).exp() for t in (base, expert_i, expert_j, composed)]
    return overlap_weights_from_probs(*probabilities)


def overlap_weights_from_probs(
    base_probs: torch.Tensor, probs_i: torch.Tensor, probs_j: torch.Tensor, composed_probs: torch.Tensor
) -> torch.Tensor:
    """`w = max(p_b, p_i, p_j, q)` per token from probabilities, the kernel of `overlap_weights`.

    Args:
        base_probs, probs_i, probs_j, composed_probs: `(..., V)` probabilities, e.g.
            `(batch, seq, vocab)`.

    Returns:
        `(..., V)`.
    """
    return torch.maximum(torch.maximum(base_probs, probs_i), torch.maximum(probs_j, composed_probs))


class OverlapSums(NamedTuple):
    """Sums over the vocabulary (and, when added up, over positions) that overlap ratios use.

    All are `(...)` float32:
    `product = Σ w|δ̃_i||δ̃_j|`, `conflict = Σ_{sign δ̃_i ≠ sign δ̃_j} w|δ̃_i||δ̃_j|`,
    `square_i = Σ w δ̃_i²`, `square_j = Σ w δ̃_j²`.
    """

    product: torch.Tensor
    conflict: torch.Tensor
    square_i: torch.Tensor
    square_j: torch.Tensor


def overlap_sums(centred_i: torch.Tensor, centred_j: torch.Tensor, weight: torch.Tensor) -> OverlapSums:
    """The weighted sums over V behind `weighted_overlap` and `sign_conflict_mass`.

    Args:
        centred_i, centred_j: `(..., V)` centred deltas δ̃_i, δ̃_j; weight: `(..., V)`.
    """
    product = weight * centred_i.abs() * centred_j.abs()  # (..., V)
    conflict = torch.where(centred_i * centred_j < 0, product, 0.0)
    return OverlapSums(
        product=product.sum(-1),
        conflict=conflict.sum(-1),
        square_i=(weight * centred_i.square()).sum(-1),
        square_j=(weight * centred_j.square()).sum(-1),
    )


def overlap_ratio(sums: OverlapSums) -> torch.Tensor:
    """`O_ij = Σ w|δ̃_i||δ̃_j| / sqrt(Σ w δ̃_i² · Σ w δ̃_j²)` from `OverlapSums`, in [0, 1].

    A weighted cosine of |δ̃_i| and |δ̃_j|: 0 when the deltas live on disjoint tokens, 1 when
    they are proportional in magnitude. Defined as 0 where either delta is 0 everywhere.
    """
    denominator = (sums.square_i * sums.square_j).sqrt()
    return torch.where(denominator > 0, sums.product / denominator.clamp(min=1e-30), torch.zeros_like(denominator))


def conflict_ratio(sums: OverlapSums) -> torch.Tensor:
    """Sign-conflict mass `Σ_{sign δ̃_i ≠ sign δ̃_j} w|δ̃_i||δ̃_j| / Σ w|δ̃_i||δ̃_j|`, in [0, 1].

    The share of the overlap where the experts push a token in opposite directions: the
    output-space twin of TIES's sign conflicts. 0 where there is no overlap at all.
    """
    return torch.where(sums.product > 0, sums.conflict / sums.product.clamp(min=1e-30), torch.zeros_like(sums.product))


def norm_ratio(sums: OverlapSums) -> torch.Tensor:
    """`ρ_ij = sqrt(max(S_i, S_j) / min(S_i, S_j))`, `S_i = Σ w δ̃_i²`, from `OverlapSums`, ≥ 1.

    +inf where only the smaller sum is 0, NaN where both are (an expert equal to the base up to a shift).
    """
    larger, smaller = torch.maximum(sums.square_i, sums.square_j), torch.minimum(sums.square_i, sums.square_j)
    return (larger / smaller).sqrt()


def delta_norm_ratio(centred_i: torch.Tensor, centred_j: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """How much larger one expert's logit delta is than the other's, where the pair's tokens carry mass.

    `ρ_ij = sqrt(max(S_i, S_j) / min(S_i, S_j))` with `S_i = Σ_t Σ_v w_t(v) δ̃_i(t, v)²`, pooled over every
    position given: the ratio of the larger to the smaller RMS over positions of the weighted norms
    `‖δ̃_i(t)‖_w = sqrt(Σ_v w_t(v) δ̃_i(t, v)²)`, with the centred deltas δ̃ (`centred_deltas`, in the
    report's centre) and the overlap weight `w = max(p_b, p_i, p_j, q)` (`overlap_weights`). 1 when the
    deltas are equally large; the larger it is, the more the larger delta decides a composition (or a
    merge) wherever the two overlap.

    Why this norm: it is the one the mass overlap `O_ij` divides by (`overlap_ratio`), so `O_ij` (the
    weighted cosine of |δ̃_i| and |δ̃_j|) and `ρ_ij` (the ratio of their lengths) read together, and it
    streams as two sums; the weight keeps out tokens that no model would emit, whose log-ratios drift
    freely in fine-tuning and would set an unweighted norm over a large vocabulary.

    Args:
        centred_i: `(..., V)` centred delta of expert i, e.g. `(batch, seq, vocab)`.
        centred_j: `(..., V)` centred delta of expert j.
        weight: `(..., V)` the weight of each token.

    Returns:
        `()` float32: +inf where only one delta is 0 at every weighted token, NaN where both are.
    """
    if not centred_i.shape == centred_j.shape == weight.shape:
        raise ValueError(
            "`centred_i`, `centred_j` and `weight` must have the same shape (..., V), got "
            f"{tuple(centred_i.shape)}, {tuple(centred_j.shape)} and {tuple(weight.shape)}"
        )
    pooled = OverlapSums(*(total.sum() for total in overlap_sums(centred_i, centred_j, weight)))
    return norm_ratio(pooled)


def weighted_overlap(centred_i: torch.Tensor, centred_j: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-position weighted overlap `O_ij` (see `overlap_ratio`): `(...)` float32."""
    return overlap_ratio(overlap_sums(centred_i, centred_j, weight))


def sign_conflict_mass(centred_i: torch.Tensor, centred_j: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-position sign-conflict mass (see `conflict_ratio`): `(...)` float32."""
    return conflict_ratio(overlap_sums(centred_i, centred_j, weight))
