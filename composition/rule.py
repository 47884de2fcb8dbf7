"""The composition rule of Kumar, Bucarelli & Natale (2026), as a pure function on tensors.

    log p̂ = log p_b + Σ_i w_i (log p_i − log p_b) − log Z

With every w_i = 1 this is the paper's product of experts p_b · Π_i p_i / p_b.

`compose_logprobs_unchecked` is the arithmetic alone. `compose_logprobs` runs `check_composition` on its
inputs first, and refuses a result that rules out every token; a decoding loop checks once and then calls
the unchecked rule at every step.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch

# Where a component's exponent is not positive, its -inf log-probs are clamped to this floor so
# that 0·(−inf) and (−c)·(−inf) stay finite. The paper's released code clamps the base the same
# way: `clamp(log p_base, min=-1e4)`.
LOGPROB_FLOOR = -1e4

# The largest |w_i| accepted. Past a few units a weight already makes the composition near-deterministic; a weight
# of 1e38 overflows float32 in `w_i · ℓ_i` and ends in NaN. With |w| ≤ 100 and log-probs clamped at the floor,
# every term stays below 1e6 · k, far from float32's range, so the bound is a check on the input, not on precision.
MAX_ABS_WEIGHT = 100.0

# k exponents: a float per expert, or a tensor (k,) or (k, ...) broadcastable to the leading dims of `base`.
Weights = Sequence[float] | torch.Tensor | None


def compose_logprobs_unchecked(
    base: torch.Tensor,
    experts: Sequence[torch.Tensor],
    weights: Weights = None,
    floor: float = LOGPROB_FLOOR,
) -> torch.Tensor:
    """The rule's arithmetic, log_softmax((1 − Σw) · b + Σ_i w_i · ℓ_i), with no checks and no host sync.

    Arguments and result are `compose_logprobs`'s. For inputs already checked (`check_composition`) or
    built to fit, e.g. by a decoding loop, which then looks for NaN in the result itself: a position
    where every token is ruled out comes out NaN here, where `compose_logprobs` raises.
    """
    return torch.log_softmax(_exponent_sum(base, experts, weights, floor), dim=-1)


def compose_logprobs(
    base: torch.Tensor,
    experts: Sequence[torch.Tensor],
    weights: Weights = None,
    floor: float = LOGPROB_FLOOR,
    validate: bool | None = None,
) -> torch.Tensor:
    """Compose next-token distributions: log_softmax(b + Σ_i w_i (ℓ_i − b)), after checking the inputs.

    Args:
        base: `(..., V)` logits or log-probs of the base model.
        experts: k tensors of the same shape as `base`, one per expert.
        weights: k exponents `w_i`, default 1.0 each (the paper's rule). A float sequence, or a
            tensor of shape `(k,)` or `(k, ...)` broadcastable to `base.shape[:-1]`, e.g. per-position
            weights `(k, B, T)` for gating.
        floor: the finite value that -inf log-probs are clamped to where their exponent is ≤ 0.
        validate: deprecated; call `compose_logprobs_unchecked` for the rule without its checks.
            False skipped the checks of values (NaN, +inf, all -inf rows, non-finite tensor `weights`).

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
        TypeError: `base` or an expert that is not a tensor.
        ValueError: zero experts; a shape or vocabulary mismatch; `weights` of the wrong length or
            shape, or not finite; a `floor` that is not finite and negative; NaN or +inf in any
            input; or a position where every token is ruled out.
    """
    if validate is not None:
        warnings.warn(
            "`compose_logprobs(..., validate=...)` is deprecated and will be removed in the next release; "
            "call `compose_logprobs_unchecked` for the rule without its checks",
            DeprecationWarning,
            stacklevel=2,
        )
    if validate is False:
        checked_weights = _check_arguments(base, experts, weights, floor)
        return torch.log_softmax(_exponent_sum(base, experts, checked_weights, floor), dim=-1)
    total = _exponent_sum(base, experts, _check_inputs(base, experts, weights, floor), floor)  # (..., V)
    if torch.isneginf(total).all(dim=-1).any():
        raise ValueError(
            "every token is ruled out (-inf) by some component with a positive exponent at "
            "one or more positions; the composed distribution is undefined there"
        )
    return torch.log_softmax(total, dim=-1)


def check_composition(
    base: torch.Tensor, experts: Sequence[torch.Tensor], weights: Weights = None, floor: float = LOGPROB_FLOOR
) -> None:
    """Raise what `compose_logprobs` raises for these inputs before it computes (each value check reads back a flag).

    Types, shapes and vocabularies; NaN, +inf and all -inf rows in each component; the number, shape
    and finiteness of `weights`; `floor`."""
    _check_inputs(base, experts, weights, floor)


def check_composition_arguments(
    base: torch.Tensor, experts: Sequence[torch.Tensor], weights: Weights = None, floor: float = LOGPROB_FLOOR
) -> None:
    """The checks of `check_composition` that read nothing back from the device: types, shapes, vocabularies,
    the number and shape of `weights` (a list's values too) and `floor`."""
    _check_arguments(base, experts, weights, floor)


def _check_arguments(
    base: torch.Tensor, experts: Sequence[torch.Tensor], weights: Weights, floor: float
) -> torch.Tensor | None:
    """`check_composition_arguments`, returning the checked `weights` as a float32 tensor (None stays None)."""
    _check_components(base, experts, floor)
    return _check_weight_shape(weights, len(experts), base)


def _check_inputs(
    base: torch.Tensor, experts: Sequence[torch.Tensor], weights: Weights, floor: float
) -> torch.Tensor | None:
    """`check_composition`, returning the checked `weights` as a float32 tensor (None stays None)."""
    _check_components(base, experts, floor)
    for name, tensor in [("base", base), *((f"experts[{index}]", expert) for index, expert in enumerate(experts))]:
        check_scores(tensor, f"`{name}`")
        if torch.isneginf(tensor).all(dim=-1).any():
            raise ValueError(f"`{name}` rules out every token (-inf everywhere) at one or more positions")
    weight_tensor = _check_weight_shape(weights, len(experts), base)
    if weight_tensor is not None and not torch.isfinite(weight_tensor).all():
        where = tuple((~torch.isfinite(weight_tensor)).nonzero()[0].tolist())
        raise ValueError(f"`weights` must be finite, got {weight_tensor[where].item()} at index {where}")
    if weight_tensor is not None and (weight_tensor.abs() > MAX_ABS_WEIGHT).any():
        where = tuple((weight_tensor.abs() > MAX_ABS_WEIGHT).nonzero()[0].tolist())
        raise ValueError(
            f"`weights` must lie in [-{MAX_ABS_WEIGHT:g}, {MAX_ABS_WEIGHT:g}], got {weight_tensor[where].item()} at "
            f"index {where}"
        )
    return weight_tensor


def check_weights(weights: object, num_experts: int) -> list[float] | None:
    """`weights` as a list of `num_experts` finite floats (None stays None); errors name the index and value."""
    if weights is None:
        return None
    if isinstance(weights, (str, bytes)) or not isinstance(weights, (Sequence, torch.Tensor)):
        raise TypeError(f"`weights` must be a list of {num_experts} numbers, got {type(weights).__name__}")
    values = []
    for index, weight in enumerate(weights):
        try:
            value = float(weight)
        except (TypeError, ValueError):
            raise TypeError(f"`weights[{index}]` must be a number, got {weight!r}") from None
        if not math.isfinite(value):
            raise ValueError(f"`weights[{index}]` must be a finite number, got {value}")
        if abs(value) > MAX_ABS_WEIGHT:
            raise ValueError(
                f"`weights[{index}]` must lie in [-{MAX_ABS_WEIGHT:g}, {MAX_ABS_WEIGHT:g}] (the documented bound), "
                f"got {value:g}"
            )
        values.append(value)
    if len(values) != num_experts:
        raise ValueError(f"`weights` must hold one weight per expert ({num_experts}), got {len(values)}")
    return values


def check_scores(tensor: torch.Tensor, name: str) -> None:
    """Refuse NaN and +inf in logits or log-probs (-inf, a ruled-out token, is allowed); name the first index."""
    invalid = torch.isnan(tensor) | torch.isposinf(tensor)
    if invalid.any():
        where = tuple(invalid.nonzero()[0].tolist())
        value = "NaN" if math.isnan(tensor[where].item()) else "+inf"
        raise ValueError(f"{name} contains {value} at index {where}; logits and log-probs must be finite or -inf")


def _check_components(base: torch.Tensor, experts: Sequence[torch.Tensor], floor: float) -> None:
    """Types, count, shapes and vocabularies of the components, and `floor`: what needs no device sync."""
    _check_tensor(base, "base")
    if isinstance(experts, torch.Tensor) or not isinstance(experts, Sequence):
        raise TypeError(f"`experts` must be a list of tensors, got {type(experts).__name__}")
    if len(experts) == 0:
        raise ValueError("`experts` must hold at least one tensor, got an empty sequence")
    if not (isinstance(floor, (int, float)) and math.isfinite(floor) and floor < 0):
        raise ValueError(f"`floor` must be a finite negative number (a log-prob), got {floor!r}")
    for index, expert in enumerate(experts):
        _check_tensor(expert, f"experts[{index}]")
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


def _check_tensor(value: object, name: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor of logits or log-probs, got {type(value).__name__}")


def _check_weight_shape(weights: Weights, k: int, base: torch.Tensor) -> torch.Tensor | None:
    """Check `weights` on the host (a list: its values; a tensor: its shape); return it as a float32 tensor, or None."""
    if weights is None:
        return None
    if not isinstance(weights, torch.Tensor):
        weights = check_weights(weights, k)
    weight_tensor = torch.as_tensor(weights, dtype=torch.float32, device=base.device)
    if weight_tensor.dim() == 0 or weight_tensor.shape[0] != k:
        got = "a scalar" if weight_tensor.dim() == 0 else f"length {weight_tensor.shape[0]}"
        raise ValueError(f"`weights` must hold one weight per expert ({k}), got {got}")
    # Per-position weights (k, *lead) align with base's leading dims: each equal or 1.
    lead, positions = tuple(weight_tensor.shape[1:]), tuple(base.shape[:-1])
    if len(lead) > len(positions) or any(w not in (1, p) for w, p in zip(lead, positions)):
        raise ValueError(
            f"`weights` of shape {tuple(weight_tensor.shape)} must be (k,) or (k, ...) matching the leading dims of "
            f"`base` {positions} (each the same size or 1), e.g. ({k}, {', '.join(map(str, positions))})"
        )
    return weight_tensor


def _exponent_sum(base: torch.Tensor, experts: Sequence[torch.Tensor], weights: Weights, floor: float) -> torch.Tensor:
    """(1 − Σw) · b + Σ_i w_i · ℓ_i over log-softmaxed components `(..., V)`: the rule before it is renormalised."""
    weight_tensor = _weight_tensor(weights, len(experts), base)  # (k, ..., 1), broadcasts against base
    base_logprobs = torch.log_softmax(base.float(), dim=-1)  # (..., V)
    total = _weighted(base_logprobs, 1.0 - weight_tensor.sum(0), floor)  # (..., V)
    for index, expert in enumerate(experts):
        expert_logprobs = torch.log_softmax(expert.float(), dim=-1)  # (..., V)
        total = total + _weighted(expert_logprobs, weight_tensor[index], floor)
    return total


def _weight_tensor(weights: Weights, k: int, base: torch.Tensor) -> torch.Tensor:
    """`weights` as a float32 tensor of shape (k, ..., 1) that broadcasts against `base` (None: all 1)."""
    if weights is None:
        return torch.ones(k, *([1] * base.dim()), device=base.device)
    weight_tensor = torch.as_tensor(weights, dtype=torch.float32, device=base.device)  # (k, *lead)
    # (k, *lead) -> (k, *lead, 1, ..., 1) so that it broadcasts over (..., V).
    return weight_tensor.reshape(*weight_tensor.shape, *([1] * (base.dim() + 1 - weight_tensor.dim())))


def _weighted(logprobs: torch.Tensor, exponent: torch.Tensor | float, floor: float) -> torch.Tensor:
    """exponent · logprobs, with -inf kept where exponent > 0 and clamped to `floor` elsewhere."""
    exponent = torch.as_tensor(exponent, dtype=torch.float32, device=logprobs.device)
    clamped = logprobs.clamp(min=floor)
    return torch.where(exponent > 0, exponent * logprobs, exponent * clamped)
