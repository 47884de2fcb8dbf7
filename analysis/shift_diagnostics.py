"""Diagnostics of the experts' top-1 tokens, which stay defined where every position is co-active.

A KL threshold calls an expert active wherever its distribution moves at all, and fine-tuned experts
move a little at nearly every position, so on real LoRA experts every position is co-active and the
single-active projective error (`diagnostics.single_active_error`) has nothing to average over. An
expert's *decisions* change far less often: Lin et al. (ICLR 2024, "The Unlocking Spell on Base LLMs:
Rethinking Alignment via In-Context Learning", the URIAL token-shift analysis) find that an aligned
chat model's greedy token differs from its base's at only a few per cent of positions. These
statistics read those token shifts.

Notation as in `mergecompose.analysis.diagnostics`, plus, per position t:

* `t_b = argmax_v b(v)` the base's top-1 token and `t_i = argmax_v ℓ_i(v)` expert i's (`torch.argmax`:
  the first of tied maxima);
* `s_i = [t_i ≠ t_b]`, expert i *shifts* the base's top-1 token.

Pure functions on tensors: no model, no I/O, no global state.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mergecompose.analysis.diagnostics import Experts, _logprobs, _stack, kl_from_logprobs


def top1_tokens(base: torch.Tensor, experts: Experts) -> torch.Tensor:
    """The top-1 token of the base and of every expert: `(t_b, t_1, …, t_k)`.

    Args:
        base: `(..., V)` logits or log-probs; experts: `(k, ..., V)` or k tensors `(..., V)`.

    Returns:
        `(k+1, ...)` int64 token ids, the base's row first; ties go to the lowest token id.
    """
    stacked = _stack(experts, base)  # (k, ..., V)
    return torch.cat([_logprobs(base)[None], stacked]).argmax(-1)


def _check_tokens(tokens: torch.Tensor) -> None:
    if tokens.dim() < 1 or tokens.shape[0] < 2 or tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise ValueError(
            "`tokens` must be an integer tensor (k+1, ...) of top-1 token ids, the base's row first and k ≥ 1 "
            f"experts after it (`top1_tokens`), got dtype {tokens.dtype} and shape {tuple(tokens.shape)}"
        )


def top1_shifts(tokens: torch.Tensor) -> torch.Tensor:
    """`s_i = [t_i ≠ t_b]` at every position: where expert i shifts the base's top-1 token.

    Args:
        tokens: `(k+1, ...)` from `top1_tokens`, the base's row first.

    Returns:
        `(k, ...)` bool.
    """
    _check_tokens(tokens)
    return tokens[1:] != tokens[:1]


class ShiftCounts(NamedTuple):
    """Counts over positions behind `top1_shift_rate` and `shift_agreement`; they add over batches.

    `positions` `()` = N; `shifted` `(k,)` = Σ_t s_i; `both_shifted` `(k, k)` = Σ_t s_i s_j (its diagonal
    is `shifted`); `same_token` `(k, k)` = Σ_t s_i s_j [t_i = t_j]. All int64.
    """

    positions: torch.Tensor
    shifted: torch.Tensor
    both_shifted: torch.Tensor
    same_token: torch.Tensor


def shift_counts(tokens: torch.Tensor, mask: torch.Tensor | None = None) -> ShiftCounts:
    """The counts of top-1 shifts, alone and by pairs, over the positions in `mask`.

    Args:
        tokens: `(k+1, ...)` from `top1_tokens`, the base's row first, e.g. `(k+1, batch, seq)`;
        mask: `(...)` bool, the positions to count (e.g. the attention mask); default all.

    Returns:
        `ShiftCounts`, on the CPU.
    """
    shifts = top1_shifts(tokens)  # (k, ...)
    if mask is not None:
        if tuple(mask.shape) != tuple(tokens.shape[1:]):
            raise ValueError(
                f"`mask` must have the positions' shape tokens.shape[1:] = {tuple(tokens.shape[1:])}, "
                f"got {tuple(mask.shape)}"
            )
        shifts = shifts[:, mask.bool()]  # (k, N)
        tokens = tokens[:, mask.bool()]  # (k+1, N)
    k = shifts.shape[0]
    shifts, experts = shifts.reshape(k, -1).long(), tokens[1:].reshape(k, -1)  # (k, N) each
    both = shifts[:, None] * shifts[None]  # (k, k, N)
    return ShiftCounts(
        positions=torch.tensor(shifts.shape[1], dtype=torch.int64),
        shifted=shifts.sum(1).cpu(),
        both_shifted=both.sum(-1).cpu(),
        same_token=(both * (experts[:, None] == experts[None])).sum(-1).cpu(),
    )


def top1_shift_rate(counts: ShiftCounts) -> torch.Tensor:
    """The top-1 shift rate `r_i = (1/N) Σ_t [t_i ≠ t_b]`: the share of positions where expert i's top-1
    token differs from the base's (Lin et al., ICLR 2024: a few per cent for an aligned chat model).

    Args:
        counts: from `shift_counts` (summed over batches: the counts add).

    Returns:
        `(k,)` float64 in [0, 1].
    """
    if int(counts.positions) <= 0:
        raise ValueError(f"`counts` must count at least one position, got positions = {int(counts.positions)}")
    return counts.shifted.double() / int(counts.positions)


class ShiftAgreement(NamedTuple):
    """Per pair (i, j), both `(k, k)` float64 and symmetric.

    `both_shift_rate` = (1/N) Σ_t s_i s_j, the share of positions that both experts shift;
    `same_token_share` = Σ_t s_i s_j [t_i = t_j] / Σ_t s_i s_j, of those, the share where they shift to
    the same token; NaN where no position is shifted by both (0/0, undefined).
    """

    both_shift_rate: torch.Tensor
    same_token_share: torch.Tensor


def shift_agreement(counts: ShiftCounts) -> ShiftAgreement:
    """Where two experts both overrule the base's top-1 token, do they agree on the new one?

    `both_shift_rate_ij = (1/N) Σ_t s_i s_j` and `same_token_share_ij = Σ_t s_i s_j [t_i = t_j] / Σ_t s_i s_j`,
    with `s_i = [t_i ≠ t_b]`. A low rate means the experts' decisions rarely collide; where they do, a
    share near 1 means they push to the same token (composing reinforces it), near 0 that they pull
    apart (composing must pick one, or a third token).

    Args:
        counts: from `shift_counts`.

    Returns:
        `ShiftAgreement`: `(k, k)` each; `same_token_share` is NaN where `Σ_t s_i s_j = 0`.
    """
    if int(counts.positions) <= 0:
        raise ValueError(f"`counts` must count at least one position, got positions = {int(counts.positions)}")
    both = counts.both_shifted.double()  # (k, k)
    share = torch.where(both > 0, counts.same_token.double() / both.clamp(min=1), float("nan"))
    return ShiftAgreement(both_shift_rate=both / int(counts.positions), same_token_share=share)


def dominant_shift_error(
    base: torch.Tensor, experts: Experts, composed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dominant-shift projective error: `KL(p_o ‖ q)` where exactly one expert o shifts the base's top-1.

    At a position where `Σ_i s_i = 1` the one expert o with `t_o ≠ t_b` is the only one that changes the
    base's decision; it owns the step, and a projective composition follows it there (Kumar, Bucarelli
    & Natale, 2026). `e_t = KL(p_o ‖ q)` measures how far the other experts' deltas (which move the
    distribution without changing its top-1 token) pull the composition away from the owner: the
    single-active error `KL(p_active ‖ q)` (`diagnostics.single_active_error`) with the owner chosen by
    top-1 shift instead of by `KL(p_i ‖ p_b) > ε`. Unlike that one, it stays defined where every position
    is co-active, as long as some position has exactly one shifting expert. Positions that no expert
    shifts are left out: no expert owns them, and the base is not the reference where every expert moves
    its distribution. The report's value is the mean over eligible positions, `Σ_t E_t e_t / Σ_t E_t`
    with `E_t = [Σ_i s_i = 1]`.

    Args:
        base: `(..., V)` the base's logits or log-probs.
        experts: `(k, ..., V)` the experts'.
        composed: `(..., V)` the composition's.

    Returns:
        `(error, eligible)`: `(...)` float32 `KL(p_o ‖ q)`, 0 where not eligible, and `(...)` bool `E_t`.
    """
    stacked, log_q = _stack(experts, base), _logprobs(composed)
    if tuple(log_q.shape) != tuple(base.shape):
        raise ValueError(f"`composed` must have the base's shape {tuple(base.shape)}, got {tuple(log_q.shape)}")
    owner_kl = kl_from_logprobs(stacked, stacked.exp(), log_q)  # (k, ...)
    return dominant_shift_error_from_tokens(top1_tokens(base, stacked), owner_kl)


def dominant_shift_error_from_tokens(
    tokens: torch.Tensor, expert_kl: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`KL(p_o ‖ q)` where exactly one expert o shifts the base's top-1 token, from the top-1 tokens and
    each expert's `KL(p_i ‖ q)`: the kernel of `dominant_shift_error`.

    Args:
        tokens: `(k+1, ...)` from `top1_tokens`, e.g. `(k+1, n)`; expert_kl: `(k, ...)` `KL(p_i ‖ q)`.

    Returns:
        `(error, eligible)`: `(...)` error (0 where not eligible) and `(...)` bool, `Σ_i s_i = 1`.
    """
    shifts = top1_shifts(tokens)  # (k, ...)
    if tuple(expert_kl.shape) != tuple(shifts.shape):
        raise ValueError(
            f"`expert_kl` must be (k, ...) = {tuple(shifts.shape)}, one row per expert of `tokens`, "
            f"got {tuple(expert_kl.shape)}"
        )
    eligible = shifts.sum(0) == 1  # (...)
    owner = shifts.long().argmax(0)  # (...): the one shifting expert where eligible
    error = expert_kl.gather(0, owner[None]).squeeze(0)  # (...)
    return torch.where(eligible, error, torch.zeros_like(error)), eligible
