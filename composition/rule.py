"""The composition rule of Kumar, Bucarelli & Natale (2026), as a pure function on tensors.

    log p̂ = log p_b + Σ_i w_i (log p_i − log p_b) − log Z

With every w_i = 1 this is the paper's product of experts p_b · Π_i p_i / p_b.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Where a component's exponent is not positive, its -inf log-probs are clamped to this floor so
# that 0·(−inf) and (−c)·(−inf) stay finite. The paper's released code clamps the base the same
# way: `clamp(log p_base, min=-1e4)`.
LOGPROB_FLOOR = -1e4


def compose_logprobs(
    base: torch.Tensor,
    experts: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor | None = None,
    floor: float = LOGPROB_FLOOR,
    validate: bool = True,
) -> torch.Tensor:
    """Compose next-token distributions: log_softmax(b + Σ_i w_i (ℓ_i − b)).

    Args:
        base: `(..., V)` logits or log-probs of the base model.
        experts: k tensors of the same shape as `base`, one per expert.
        weights: k exponents `w_i`, default 1.0 each (the paper's rule). A float sequence, or a
            tensor of shape `(k,)` or `(k, ...)` broadcastable to `base.shape[:-1]`, e.g. per-position
            weights `(k, B, T)` for gating.
        floor: the finite value that -inf log-probs are clamped to where their exponent is ≤ 0.
        validate: check for NaN and all-(-inf) rows (each check reads a flag back from the device).
            A decoding loop may pass False and check the output for NaN itself, once.

    Returns:
        `(..., V)` float32 log-probs of the composed distribution, normalised over V.

    Every input is first normalised with log-softmax in float32. The rule is rewritten as
    `(1 − Σw) · b + Σ_i w_i · ℓ_i`, a weighted sum with one exponent per component
    (the base's exponent is `1 − Σ_i w_i`, e.g. −1 for two experts). `-inf` entries follow one
    rule, stated per component:

    * exponent > 0: a `-inf` stays `-inf`. A token that any such component rules out stays
      impossible, whatever the others say.
    * exponent ≤ 0: the log-prob is clamped to `floor` first. So a token the base rules out
      (p_b = 0) but the experts allow gets the finite score `(1 − Σw)·floor + Σ w_i ℓ_i`. With two
      experts that is `+1e4 + ...`: as the limit p_b → 0 of the rule implies, such a token takes
      (nearly) all of the mass. With one expert at weight 1 the base's exponent is 0 and the
      result is exactly that expert, -inf entries included.

    Raises:
        ValueError: zero experts; a shape or vocabulary mismatch; `weights` of the wrong length;
            NaN in any input; or a position where every token is ruled out.
    """
    if len(experts) == 0:
        raise ValueError("`experts` must hold at least one tensor, got an empty sequence")
    for index, expert in enumerate(experts):
        if expert.shape[-1] != base.shape[-1]:
            raise ValueError(
                f"vocabulary size mismatch: `experts[{index}]` has V={expert.shape[-1]}, "
                f"`base` has V={base.shape[-1]}; all components must share one vocabulary"
            )
        if expert.shape != base.shape:
            raise ValueError(
                f"shape mismatch: `experts[{index}]` has shape {tuple(expert.shape)}, "
                f"`base` has {tuple(base.shape)}; all components must have the same shape"
            )
    for name, tensor in [("base", base)] + [(f"experts[{i}]", e) for i, e in enumerate(experts)] if validate else []:
        if torch.isnan(tensor).any():
            raise ValueError(f"`{name}` contains NaN; logits and log-probs must be finite or -inf")
        if torch.isneginf(tensor).all(dim=-1).any():
            raise ValueError(f"`{name}` rules out every token (-inf everywhere) at one or more positions")

    k = len(experts)
    weight_tensor = _weights_tensor(weights, k, base)  # (k, ...) broadcastable to base[..., :1]

    base_logprobs = torch.log_softmax(base.float(), dim=-1)  # (..., V)
    total = _weighted(base_logprobs, 1.0 - weight_tensor.sum(0), floor)
    for index, expert in enumerate(experts):
        expert_logprobs = torch.log_softmax(expert.float(), dim=-1)  # (..., V)
        total = total + _weighted(expert_logprobs, weight_tensor[index], floor)

    if validate and torch.isneginf(total).all(dim=-1).any():
        raise ValueError(
            "every token is ruled out (-inf) by some component with a positive exponent at "
            "one or more positions; the composed distribution is undefined there"
        )
    return torch.log_softmax(total, dim=-1)


def _weights_tensor(weights, k: int, base: torch.Tensor) -> torch.Tensor:
    """Return weights as a float32 tensor of shape (k, ..., 1) that broadcasts against base."""
    if weights is None:
        return torch.ones(k, *([1] * base.dim()), device=base.device)
    weight_tensor = torch.as_tensor(weights, dtype=torch.float32, device=base.device)
    if weight_tensor.dim() == 0 or weight_tensor.shape[0] != k:
        got = "a scalar" if weight_tensor.dim() == 0 else f"length {weight_tensor.shape[0]}"
        raise ValueError(f"`weights` must hold one weight per expert ({k}), got {got}")
    if torch.isnan(weight_tensor).any():
        raise ValueError("`weights` contains NaN")
    # (k, *lead) -> (k, *lead, 1, ..., 1) so that it broadcasts over (..., V).
    return weight_tensor.reshape(*weight_tensor.shape, *([1] * (base.dim() + 1 - weight_tensor.dim())))


def _weighted(logprobs: torch.Tensor, exponent: torch.Tensor | float, floor: float) -> torch.Tensor:
    """exponent · logprobs, with -inf kept where exponent > 0 and clamped to `floor` elsewhere."""
    exponent = torch.as_tensor(exponent, dtype=torch.float32, device=logprobs.device)
    clamped = logprobs.clamp(min=floor)
    return torch.where(exponent > 0, exponent * logprobs, exponent * clamped)
