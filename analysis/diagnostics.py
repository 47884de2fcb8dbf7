"""Activity, projectivity and linear-equivalence diagnostics as pure functions on tensors.

Where the experts' deltas overlap over the vocabulary (centred deltas, their supports, the weighted overlap)
is delta_overlap.py, in the same notation.

Notation (per position t, over a shared vocabulary of size V):

* `b = log p_b` the base, `ℓ_i = log p_i` expert i, `δ_i = ℓ_i − b` its log-probability delta;
* `q` the composed distribution `log_softmax(b + Σ_i w_i δ_i)` (`mergecompose.composition.compose_logprobs`);
* `m` the log-probs of the task-arithmetic merge `θ_b + λ Σ_i τ_i`.

Every function takes logits or log-probs, normalises them with `log_softmax` in float32, and
works on the last axis. `experts` is a `(k, ..., V)` tensor or a sequence of k `(..., V)`
tensors, `base` is `(..., V)`; typically `(...)` is `(batch, seq)`. Nothing here looks at a
model, a file or global state. The definitions follow Kumar, Bucarelli & Natale (2026):
factorized conditionals (disjoint supports) and factorizable skills (disjoint active
intervals `[τ1, τ2)`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Experts = torch.Tensor | Sequence[torch.Tensor]


def _logprobs(tensor: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(tensor.float(), dim=-1)


def _stack(experts: Experts, base: torch.Tensor | None = None, name: str = "experts") -> torch.Tensor:
    """Return experts as a float32 log-prob tensor `(k, ..., V)`, checked against `base`."""
    if isinstance(experts, torch.Tensor):
        stacked = experts
    else:
        if len(experts) == 0:
            raise ValueError(f"`{name}` must hold at least one tensor, got an empty sequence")
        shapes = {tuple(e.shape) for e in experts}
        if len(shapes) != 1:
            raise ValueError(f"`{name}` tensors must share one shape, got shapes {sorted(shapes)}")
        stacked = torch.stack(list(experts))
    if base is not None and tuple(stacked.shape[1:]) != tuple(base.shape):
        raise ValueError(
            f"`{name}` must have shape (k, *base.shape) = (k, {', '.join(map(str, base.shape))}), "
            f"got {tuple(stacked.shape)}"
        )
    return _logprobs(stacked)


# ---------------------------------------------------------------------------------------------
# Divergences


def kl_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) = Σ_v p(v) (log p(v) − log q(v)) over the last axis.

    Args:
        p: `(..., V)` logits or log-probs (normalised here with log-softmax).
        q: `(..., V)` logits or log-probs, the same shape.

    Returns:
        `(...)` float32, in nats. Terms with p(v) = 0 contribute 0 (0·log 0 = 0); a token with
        p(v) > 0 and q(v) = 0 gives +inf. Rounding can make a KL of identical distributions a
        few ulps below 0, so the result is clamped at 0. Same value as
        `torch.nn.functional.kl_div(q, p, log_target=True, reduction="none").sum(-1)`.
    """
    if p.shape != q.shape:
        raise ValueError(f"`p` and `q` must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    log_p = _logprobs(p)
    return kl_from_logprobs(log_p, log_p.exp(), _logprobs(q))


def kl_from_logprobs(log_p: torch.Tensor, p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) = Σ_v p(v) (log p(v) − log q(v)) from inputs that are already normalised.

    The kernel of `kl_divergence`, for callers that normalise a batch once and reuse it (the
    streaming accumulator). Nothing is re-normalised here.

    Args:
        log_p, log_q: `(..., V)` normalised log-probs, e.g. `(batch, seq, vocab)`;
        p: `exp(log_p)`, same shape.

    Returns:
        `(...)`, e.g. `(batch, seq)`, in nats: 0·log 0 = 0, clamped at 0 against rounding.
    """
    terms = torch.where(p > 0, p * (log_p - log_q), 0.0)  # (..., V)
    return terms.sum(-1).clamp(min=0)


def conditional_kl(p: torch.Tensor, q: torch.Tensor, subset: torch.Tensor) -> torch.Tensor:
    """KL(p(·|M) ‖ q(·|M)) of the two distributions conditioned on a token subset M.

    `p(v|M) = p(v) / Σ_{u∈M} p(u)` for v ∈ M, and 0 outside M.

    Args:
        p: `(..., V)` logits or log-probs.
        q: `(..., V)` logits or log-probs, the same shape.
        subset: `(..., V)` bool mask of M, broadcastable to `p`.

    Returns:
        `(...)` float32; 0 where M is empty or p gives M no mass.
    """
    if p.shape != q.shape:
        raise ValueError(f"`p` and `q` must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    log_p, log_q = _logprobs(p), _logprobs(q)
    return _conditional_kl(log_p, log_p.exp(), log_q, log_q.exp(), subset.bool().expand(p.shape))


def _conditional_kl(log_p, p, log_q, q, subset) -> torch.Tensor:
    """KL(p(·|M) ‖ q(·|M)) = (1/P(M)) Σ_{v∈M} p(v)(log p(v) − log q(v)) − log P(M) + log Q(M).

    From normalised log-probs and probabilities `(..., V)`, so no re-normalisation is needed.
    """
    zero = 0.0
    terms = torch.where(subset & (p > 0), p * (log_p - log_q), zero).sum(-1)  # (...)
    mass_p = torch.where(subset, p, zero).sum(-1)
    mass_q = torch.where(subset, q, zero).sum(-1)
    empty = mass_p <= 0
    value = terms / mass_p.clamp(min=1e-38) - mass_p.clamp(min=1e-38).log() + mass_q.clamp(min=1e-38).log()
    return torch.where(empty, torch.zeros_like(value), value.clamp(min=0))


# ---------------------------------------------------------------------------------------------
# 1. Activity in time


def expert_activity(base: torch.Tensor, experts: Experts) -> torch.Tensor:
    """Activity `a_{i,t} = KL(p_i ‖ p_b)` of every expert at every position.

    Args:
        base: `(..., V)`; experts: `(k, ..., V)` or k tensors `(..., V)`.

    Returns:
        `(k, ...)` float32, in nats.
    """
    stacked = _stack(experts, base)
    return kl_from_logprobs(stacked, stacked.exp(), _logprobs(base))


def active_experts(activity: torch.Tensor, epsilon: float) -> torch.Tensor:
    """The active sets `A_t(ε) = {i : a_{i,t} > ε}` as a bool tensor `(k, ...)`."""
    if not epsilon >= 0:
        raise ValueError(f"`epsilon` must be >= 0, got {epsilon}")
    return activity > epsilon


def coactivation_rate(activity: torch.Tensor, epsilon: float, mask: torch.Tensor | None = None) -> float:
    """`P(|A_t(ε)| ≥ 2)`: the share of positions at which two or more experts are active.

    Args:
        activity: `(k, ...)` from `expert_activity`.
        mask: `(...)` bool, the positions to count (e.g. the attention mask); default all.
    """
    coactive = active_experts(activity, epsilon).sum(0) >= 2  # (...)
    if mask is None:
        mask = torch.ones_like(coactive)
    mask = mask.bool()
    count = int(mask.sum())
    return float((coactive & mask).sum()) / count if count else 0.0


def active_intervals(activity: torch.Tensor, epsilon: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Each expert's active interval `[τ1, τ2)` per sequence: the estimate of its stopping times.

    `τ1` is the first position where `a_{i,t} > ε` and `τ2` is one past the last such position,
    so `[τ1, τ2)` is the smallest interval holding every active step (steps inside it where the
    expert happens to agree with the base, e.g. copying a letter it does not rewrite, belong to
    the skill phase too). Positions outside `mask` never count as active.

    Args:
        activity: `(k, B, T)`; mask: `(B, T)` bool, default all.

    Returns:
        `(k, B, 2)` int64 column indices `(τ1, τ2)`; `(-1, -1)` where the expert is never active.
    """
    if activity.dim() != 3:
        raise ValueError(f"`activity` must be (k, batch, seq), got shape {tuple(activity.shape)}")
    active = active_experts(activity, epsilon)  # (k, B, T)
    if mask is not None:
        active = active & mask.bool()[None]
    steps = torch.arange(active.shape[-1], device=active.device)
    sentinel = active.shape[-1]
    first = torch.where(active, steps, sentinel).amin(-1)  # (k, B)
    last = torch.where(active, steps, -1).amax(-1)  # (k, B)
    never = ~active.any(-1)
    first = torch.where(never, -1, first)
    end = torch.where(never, -1, last + 1)
    return torch.stack([first, end], dim=-1)


def interval_intersections(intervals: torch.Tensor) -> torch.Tensor:
    """Pairwise intersection lengths `|[τ1_i, τ2_i) ∩ [τ1_j, τ2_j)|`.

    Args:
        intervals: `(k, B, 2)` from `active_intervals` (`(-1, -1)` = never active).

    Returns:
        `(k, k, B)` int64; 0 where either expert is never active.
    """
    start, end = intervals[..., 0], intervals[..., 1]  # (k, B)
    length = (torch.minimum(end[:, None], end[None]) - torch.maximum(start[:, None], start[None])).clamp(min=0)
    never = start < 0  # (k, B)
    return torch.where(never[:, None] | never[None], 0, length)


# ---------------------------------------------------------------------------------------------
# 2. Overlap over the vocabulary: delta_overlap.py


# ---------------------------------------------------------------------------------------------
# 3. Projective error


def single_active_error(
    base: torch.Tensor, experts: Experts, composed: torch.Tensor, active: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`KL(p_active ‖ q)` on the steps where at most one expert is active.

    With one active expert i the reference is `p_i`; with none it is the base `p_b`. Under joint
    factorizability (disjoint active intervals, inactive experts equal to the base) the
    composition equals the reference exactly, so the error is 0.

    Args:
        base: `(..., V)` the base's logits or log-probs.
        experts: `(k, ..., V)` the experts'.
        composed: `(..., V)` the composition's.
        active: `(k, ...)` bool, which experts are active at each position.

    Returns:
        `(kl, eligible)`: `(...)` float32 KL (0 where not eligible) and `(...)` bool,
        `|A_t| ≤ 1`.
    """
    return single_active_error_from_logprobs(_logprobs(base), _stack(experts, base), _logprobs(composed), active)


def single_active_error_from_logprobs(
    base: torch.Tensor, experts: torch.Tensor, composed: torch.Tensor, active: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`KL(p_ref ‖ q)` where `|A_t| ≤ 1`, `p_ref` the one active expert or else the base.

    The kernel of `single_active_error`, on inputs that are already normalised.

    Args:
        base: `(..., V)` normalised log-probs, e.g. `(batch, seq, vocab)`; experts: `(k, ..., V)`;
        composed: `(..., V)` log q; active: `(k, ...)` bool, the active sets `A_t`.

    Returns:
        `(kl, eligible)`: `(...)` KL (0 where not eligible) and `(...)` bool, `|A_t| ≤ 1`.
    """
    eligible = active.sum(0) <= 1  # (...)
    # Index 0 is the base, 1 + i expert i.
    choice = torch.where(active.any(0), active.float().argmax(0) + 1, 0)  # (...)
    components = torch.cat([base[None], experts])  # (k+1, ..., V)
    reference = components.gather(0, choice[None, ..., None].expand(1, *base.shape)).squeeze(0)  # (..., V)
    kl = kl_from_logprobs(reference, reference.exp(), composed)
    return torch.where(eligible, kl, torch.zeros_like(kl)), eligible


def restricted_projective_error(
    base: torch.Tensor, experts: Experts, composed: torch.Tensor, supports: torch.Tensor
) -> torch.Tensor:
    """Per expert, `KL(p_i(·|S_i ∪ B) ‖ q(·|S_i ∪ B))`, with `B = V \\ ∪_j S_j` the background.

    Factorized conditionals: if every other expert j equals the base up to a constant factor on
    `S_i ∪ B` (it acts only on its own `S_j`), then on that set `q ∝ p_b · p_i/p_b = p_i`, and
    this KL is exactly 0 (Kumar, Bucarelli & Natale, 2026, projective composition).

    Args:
        base: `(..., V)` the base's logits or log-probs.
        experts: `(k, ..., V)` the experts'.
        composed: `(..., V)` the composition's.
        supports: `(k, ..., V)` bool, from `delta_supports` (delta_overlap.py).

    Returns:
        `(k, ...)` float32.
    """
    stacked, log_q = _stack(experts, base), _logprobs(composed)
    return restricted_projective_error_from_logprobs(stacked, stacked.exp(), log_q, log_q.exp(), supports)


def restricted_projective_error_from_logprobs(
    experts: torch.Tensor,
    expert_probs: torch.Tensor,
    composed: torch.Tensor,
    composed_probs: torch.Tensor,
    supports: torch.Tensor,
) -> torch.Tensor:
    """Per expert, `KL(p_i(·|M_i) ‖ q(·|M_i))` with `M_i = S_i ∪ (V \\ ∪_j S_j)`, from normalised inputs.

    The kernel of `restricted_projective_error`.

    Args:
        experts: `(k, ..., V)` normalised log-probs ℓ_i, e.g. `(k, batch, seq, vocab)`;
        expert_probs: `exp(experts)`; composed: `(..., V)` log q; composed_probs: `exp(composed)`;
        supports: `(k, ..., V)` bool supports S_i.

    Returns:
        `(k, ...)`.
    """
    background = ~supports.any(0)  # (..., V)
    subsets = supports | background[None]  # (k, ..., V)
    return _conditional_kl(
        experts, expert_probs, composed.expand_as(experts), composed_probs.expand_as(experts), subsets
    )


# ---------------------------------------------------------------------------------------------
# 4. Linear equivalence


def merge_compose_gap(composed: torch.Tensor, merged: torch.Tensor) -> torch.Tensor:
    """The merge-vs-compose gap `KL(q ‖ m)`: `(...)` float32.

    0 exactly when the merge's logits equal `b + Σ λ δ_i` up to a shift, which is the case
    when every task vector acts linearly on the logits (e.g. experts that differ from the base
    only in the output layer).
    """
    return kl_divergence(composed, merged)


def top1_agreement(composed: torch.Tensor, merged: torch.Tensor) -> torch.Tensor:
    """`argmax_v q == argmax_v m` per position: `(...)` bool."""
    return composed.argmax(-1) == merged.argmax(-1)


def linearization_error(
    scaled_expert: torch.Tensor, base: torch.Tensor, expert: torch.Tensor, lam: float
) -> torch.Tensor:
    """`KL(softmax(z(θ_b + λτ_i)) ‖ softmax(z_b + λ Δz_i))`, with `Δz_i = z(θ_i) − z_b`.

    How far the model at `θ_b + λτ_i` is from moving its logits along the straight line from
    the base to the expert. 0 for any λ when the task vector acts linearly on the logits; 0 at
    λ = 1 by construction. Log-probs may replace logits: they differ by a per-position shift,
    which the softmax ignores.

    Args:
        scaled_expert: `(..., V)` output of the model at `θ_b + λτ_i`; base, expert: `(..., V)`.

    Returns:
        `(...)` float32.
    """
    base_logprobs = _logprobs(base)
    line = base_logprobs + lam * (_logprobs(expert) - base_logprobs)  # (..., V)
    return kl_divergence(scaled_expert, line)


def centre(logits: torch.Tensor) -> torch.Tensor:
    """Subtract the mean over the vocabulary: the shift-free part of a logit vector."""
    return logits - logits.mean(-1, keepdim=True)


def interaction_residual(merged: torch.Tensor, scaled_experts: Experts, base: torch.Tensor) -> torch.Tensor:
    """The centred interaction residual `r = centre(z(θ_b + Σλτ_i) − Σ_i z(θ_b + λτ_i) + (k−1) z_b)`.

    For two experts at λ = 1: `z(θ_b+τ_1+τ_2) − z(θ_b+τ_1) − z(θ_b+τ_2) + z_b`. It is what the
    merge adds on top of summing each task vector's own logit change; with `r = 0` the merge's
    log-probs equal the composed ones. Centring (subtracting the mean over V) removes the
    per-position shift that softmax ignores, so log-probs may be passed instead of logits.

    Args:
        merged: `(..., V)` the merge's logits.
        scaled_experts: `(k, ..., V)` the logits of the models at `θ_b + λτ_i`.
        base: `(..., V)` the base's logits.

    Returns:
        `(..., V)` float32.
    """
    stacked = _stack(scaled_experts, base, name="scaled_experts")
    k = stacked.shape[0]
    return centre(_logprobs(merged) - stacked.sum(0) + (k - 1) * _logprobs(base))
