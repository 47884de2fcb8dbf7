"""Which of the merge and the composition keeps each expert's decisions: asymmetric, label-free diagnostics.

The overlap diagnostics say how much the experts overlap, and `merge_compose_kl` how far the merge and the
composition are apart; none says *which* of the two keeps expert i's skill. These read it at the positions
where expert i decides something the base would not:

Notation as in `mergecompose.analysis.shift_diagnostics`, per position t: `t_b`, `t_i` the top-1 tokens of the
base and of expert i, `s_i = [t_i ≠ t_b]` (expert i shifts the base's top-1 token); for each combined system r
(the merge m, the composition q) its distribution `p_r` and its top-1 token `t_r`.

* **Retention KL** of expert i in system r: `R_i(r) = Σ_t s_i KL(p_i ‖ p_r) / Σ_t s_i`, how far r is from expert
  i where expert i changes the base's decision (0: r follows expert i there exactly).
* **Kept share**: `K_i(r) = Σ_t s_i [t_r = t_i] / Σ_t s_i`, the share of those positions where r keeps expert
  i's top-1 token.
* **The base's knowledge of expert i's answers**: `L_i = (1/N) Σ_t log p_b(t_i)`, the base's mean log-probability
  of expert i's top-1 token, and `L_i^s = Σ_t s_i log p_b(t_i) / Σ_t s_i`, the same where expert i shifts the
  base. Merging is reported to work better where the base already knows the targets (Rahamim et al., "Will it
  merge?", 2026; Yadav et al., "What matters for model merging at scale?", 2024). On teacher-forced text, `t_i`
  is expert i's answer at each position; the base's top-1 agreement with it is `1 − top1_shift_rate`.

Summaries over experts (`RetentionReducer`): the skill most lost, `max_i R_i(r)` and `min_i K_i(r)`, per system,
and merge minus composition of each: a positive KL difference (or a negative kept difference) says the merge
loses the most-lost skill more than the composition does. `R_i`, `K_i` and `L_i^s` are undefined (NaN) for an
expert that shifts no measured position.

Pure functions on tensors: no model, no I/O, no global state.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mergecompose.analysis.shift_diagnostics import _check_tokens, top1_shifts


class RetentionCounts(NamedTuple):
    """Sums over positions behind `retention_measures`; they add over batches. S systems (e.g. merge, composition), k
    experts.

    `positions` `()` = N; `shifted` `(k,)` = Σ_t s_i; `kl_sum` `(S, k)` = Σ_t s_i KL(p_i ‖ p_r);
    `kept` `(S, k)` = Σ_t s_i [t_r = t_i]; `base_logprob_sum` `(k,)` = Σ_t log p_b(t_i);
    `base_logprob_shifted_sum` `(k,)` = Σ_t s_i log p_b(t_i). Counts int64, sums float64, on the CPU.
    """

    positions: torch.Tensor
    shifted: torch.Tensor
    kl_sum: torch.Tensor
    kept: torch.Tensor
    base_logprob_sum: torch.Tensor
    base_logprob_shifted_sum: torch.Tensor


def retention_counts(
    tokens: torch.Tensor, system_kl: torch.Tensor, system_top1: torch.Tensor, base_logprob: torch.Tensor
) -> RetentionCounts:
    """The sums of `retention_measures` over the positions given.

    Args:
        tokens: `(k+1, n)` top-1 tokens, the base's row first (`shift_diagnostics.top1_tokens`).
        system_kl: `(S, k, n)`, `KL(p_i ‖ p_r)` of each expert i against each system r.
        system_top1: `(S, n)` int64, each system's top-1 token.
        base_logprob: `(k, n)`, `log p_b(t_i)`: the base's log-probability of expert i's top-1 token.

    Returns:
        `RetentionCounts`.
    """
    _check_tokens(tokens)
    shifts = top1_shifts(tokens)  # (k, n)
    k, n = shifts.shape
    if system_kl.dim() != 3 or tuple(system_kl.shape[1:]) != (k, n):
        raise ValueError(f"`system_kl` must be (S, k, n) = (S, {k}, {n}), got {tuple(system_kl.shape)}")
    if tuple(system_top1.shape) != (system_kl.shape[0], n):
        raise ValueError(
            f"`system_top1` must be (S, n) = ({system_kl.shape[0]}, {n}), one row per system of `system_kl`, "
            f"got {tuple(system_top1.shape)}"
        )
    if tuple(base_logprob.shape) != (k, n):
        raise ValueError(f"`base_logprob` must be (k, n) = ({k}, {n}), got {tuple(base_logprob.shape)}")
    weight = shifts.double()  # (k, n)
    kept = (system_top1[:, None, :] == tokens[None, 1:]) & shifts[None]  # (S, k, n)
    logprob = base_logprob.double()
    return RetentionCounts(
        positions=torch.tensor(n, dtype=torch.int64),
        shifted=shifts.sum(-1).long().cpu(),
        kl_sum=(system_kl.double() * weight[None]).sum(-1).cpu(),
        kept=kept.sum(-1).long().cpu(),
        base_logprob_sum=logprob.sum(-1).cpu(),
        base_logprob_shifted_sum=(logprob * weight).sum(-1).cpu(),
    )


def add_counts(total: RetentionCounts, part: RetentionCounts) -> RetentionCounts:
    """The counts of two sets of positions together."""
    return RetentionCounts(*(a + b for a, b in zip(total, part)))


class Retention(NamedTuple):
    """`kl_mean` `(S, k)` = R_i(r); `kept_share` `(S, k)` = K_i(r); `base_logprob_mean` `(k,)` = L_i;
    `base_logprob_mean_shifted` `(k,)` = L_i^s. float64; NaN where expert i shifts no position (0/0)."""

    kl_mean: torch.Tensor
    kept_share: torch.Tensor
    base_logprob_mean: torch.Tensor
    base_logprob_mean_shifted: torch.Tensor


def retention_measures(counts: RetentionCounts) -> Retention:
    """R_i(r), K_i(r), L_i and L_i^s (see the module docstring) from summed `RetentionCounts`."""
    if int(counts.positions) <= 0:
        raise ValueError(f"`counts` must count at least one position, got positions = {int(counts.positions)}")
    shifted = counts.shifted.double()  # (k,)
    some = shifted > 0
    denominator = shifted.clamp(min=1)
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    return Retention(
        kl_mean=torch.where(some[None], counts.kl_sum / denominator[None], nan),
        kept_share=torch.where(some[None], counts.kept.double() / denominator[None], nan),
        base_logprob_mean=counts.base_logprob_sum / int(counts.positions),
        base_logprob_mean_shifted=torch.where(some, counts.base_logprob_shifted_sum / denominator, nan),
    )
