"""The acceptance rule of speculative sampling (Leviathan et al., 2023; Chen et al., 2023), on probability tensors.

A draft q proposed K tokens x_1…x_K; the target p̂ scored K+1 positions. Position by position:

    accept x_j with probability α_j = min(1, p̂_j(x_j) / q_j(x_j));
    at the first rejection emit y ~ norm(max(0, p̂_j − q_j)) and stop;
    if all K are accepted, emit a bonus token y ~ p̂_{K+1}.

Whatever q is, every emitted token is distributed exactly as p̂ given the tokens before it: a good
draft only makes it faster. Greedy decoding accepts while the draft's token is the target's argmax.
`outcome_probabilities` gives the probability of every outcome of a round, which the tests enumerate
exactly; the decoding loop (speculative/decoding.py) draws one outcome from it.
"""

from __future__ import annotations

import torch


def acceptance_probabilities(target: torch.Tensor, draft: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """α_j = min(1, p_j(x_j) / q_j(x_j)) for each drafted token x_j.

    Args:
        target: `(..., K(+1), V)` target probabilities p_j (a trailing bonus position is ignored).
        draft: `(..., K, V)` draft probabilities q_j, from which the x_j were drawn (so q_j(x_j) > 0).
        draft_tokens: `(..., K)` the drafted tokens x_j.
    Returns:
        `(..., K)` acceptance probabilities in [0, 1].
    """
    count = draft_tokens.shape[-1]
    index = draft_tokens.unsqueeze(-1)  # (..., K, 1)
    p = target[..., :count, :].gather(-1, index).squeeze(-1)  # (..., K)
    q = draft.gather(-1, index).squeeze(-1)  # (..., K)
    return torch.where(p >= q, torch.ones_like(p), p / q.clamp(min=torch.finfo(q.dtype).tiny))


def residual_distributions(target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p − q)): where a rejected position draws its token. `(..., V)` each, same shape out.

    Where p ≤ q everywhere (p = q), nothing is ever rejected (α = 1); p itself is returned there, so
    that the result is a distribution and never 0/0."""
    excess = (target - draft).clamp(min=0)  # (..., V)
    total = excess.sum(-1, keepdim=True)  # (..., 1)
    return torch.where(total > 0, excess / torch.where(total > 0, total, torch.ones_like(total)), target)


def round_outcomes(acceptance: torch.Tensor, residuals: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """The probability of each outcome of a round: `P[n, y]` = P(the first n drafts accepted, then y emitted).

        P[n, y] = Π_{j<n} α_j · (1 − α_n) · r_n(y)     for n < K   (rejected at n+1, y from the residual)
        P[K, y] = Π_{j<K} α_j · p_{K+1}(y)                          (all accepted, y is the bonus token)

    Args:
        acceptance: `(..., K)` α_j; residuals: `(..., K, V)` r_j; bonus: `(..., V)` p_{K+1}.
    Returns:
        `(..., K+1, V)`, summing to 1 over its last two dimensions.
    """
    ones = acceptance.new_ones((*acceptance.shape[:-1], 1))  # (..., 1)
    reached = torch.cat([ones, acceptance], dim=-1).cumprod(-1)  # (..., K+1): Π_{j<n} α_j
    stops = torch.cat([1 - acceptance, ones], dim=-1)  # (..., K+1): P(stop at n | reached n)
    next_token = torch.cat([residuals, bonus.unsqueeze(-2)], dim=-2)  # (..., K+1, V)
    return (reached * stops).unsqueeze(-1) * next_token


def outcome_probabilities(target: torch.Tensor, draft: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """`round_outcomes` of the acceptance rule: target `(..., K+1, V)`, draft `(..., K, V)`, tokens `(..., K)`.

    Drawing one (n, y) from this table is the sequential test (accept with α_j, at the first rejection
    draw from the residual), in one draw. Summed over n and the paths that lead to a token, it gives
    the target: P(first emitted = y) = min(p_1, q_1)(y) + (1 − Σ min(p_1, q_1)) · r_1(y) = p_1(y)."""
    count = draft_tokens.shape[-1]
    return round_outcomes(
        acceptance_probabilities(target, draft, draft_tokens),
        residual_distributions(target[..., :count, :], draft),
        target[..., count, :],
    )


def greedy_accepted(target_tokens: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """How many drafts greedy decoding accepts: the length of the run where draft = target argmax.

    target_tokens `(..., K+1)` (argmax at each position), draft_tokens `(..., K)` -> `(...,)` in [0, K]."""
    count = draft_tokens.shape[-1]
    return (draft_tokens == target_tokens[..., :count]).long().cumprod(-1).sum(-1)


def round_tokens(draft_tokens: torch.Tensor, accepted: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """The tokens a round emits, `(B, K+1)`: row r's first `accepted[r] + 1` are its accepted drafts, then its y.

    draft_tokens `(B, K)`, accepted `(B,)`, next_tokens `(B,)` (the residual or bonus token)."""
    tokens = torch.cat([draft_tokens, next_tokens.unsqueeze(-1)], dim=-1)  # (B, K+1)
    return tokens.scatter(-1, accepted.unsqueeze(-1), next_tokens.unsqueeze(-1))
