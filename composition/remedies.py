"""Optional pieces that make composition of many experts stable, each small and composable.

Each is an ordinary implementation of the remedy protocol (`mergecompose.composition.remedy_phases`): it
declares its phase (exponent, score, mask, termination), and the phases run in that fixed order around
the rule. A user's own remedy is any object that does the same.

The paper reports that composing more than two experts degraded generation, most likely
through unstable end-of-sequence prediction. The remedies, applied in this order by
`compose_with_remedies`:

1. `ActivityGate(threshold)`: expert i's weight at a position is 0 unless it is active there,
   `KL(p_i ‖ p_b) > threshold`. Inactive experts then add none of their small deltas
   ("background noise" that grows with k).
2. `PlausibilityFilter(alpha=…, top_p=…)`: before composing, keep only tokens that at least one
   component finds plausible: `p_c(v) ≥ alpha · max_v p_c` (contrastive decoding, Li et al. 2023;
   DExperts, Liu et al. 2021) and/or inside that component's top-p nucleus. Other tokens are -inf.
3. `TerminationRule(eos_token_id, source="base"|"active")`: the EOS token gets the base's
   log-prob (or the mean of the active experts' EOS log-probs, the base's where none is active)
   instead of the composed one; the other tokens keep their relative composed probabilities and
   share the rest of the mass.

Two more change the rule itself for co-active experts (fine-tuned from one base, active on almost every
token), applied to its output between 1 and 2 (at most one of them):

* `SharedDelta()`: a change of log-prob that the experts share is counted once, not k times.
* `SignConsensus(density)`: TIES's trim and sign election, per token on the experts' deltas.

Both are per token (each token's score depends on that token's deltas alone), so they commute with the
plausibility filter's mask: composing on its candidate set or on the whole vocabulary and then masking
gives the same distribution.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mergecompose.composition.remedy_imports import CLASS_KEY, ImportedRemedy
from mergecompose.composition.remedy_phases import apply_phases, by_phase, remedy_phase
from mergecompose.composition.rule import (
    LOGPROB_FLOOR,
    check_composition_arguments,
    check_scores,
    check_weights,
    compose_logprobs,
    compose_logprobs_unchecked,
)
from mergecompose.core.io import validation_message


def yaml_scalar(text: str) -> Any:
    """`text` read as a YAML scalar (`0.5` a float, `true` a bool), or the text itself where YAML cannot read it."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _check_threshold(value: object, name: str) -> None:
    """A KL threshold in nats: a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"`{name}` must be >= 0 and finite (nats of KL), got {value!r}")


def _check_share(value: object, name: str) -> None:
    """A probability share in (0, 1]."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1):
        raise ValueError(f"`{name}` must be in (0, 1], got {value!r}")


def kl_to_base(components: torch.Tensor) -> torch.Tensor:
    """KL(p_i ‖ p_b) per expert and position.

    Args:
        components: `(k+1, ..., V)` log-probs, base first.
    Returns:
        `(k, ...)` float32, `Σ_v p_i(v) (log p_i(v) − log p_b(v))`; terms with p_i(v) = 0 count 0.
    """
    base, experts = components[0], components[1:]
    p = experts.exp()
    terms = torch.where(p > 0, p * (experts - base), torch.zeros_like(p))
    return terms.sum(-1)


@dataclass(frozen=True)
class ActivityGate:
    """Weight 0 for expert i where KL(p_i ‖ p_b) ≤ threshold (phase "exponent")."""

    phase: ClassVar[Literal["exponent"]] = "exponent"
    threshold: float = 0.1

    def __post_init__(self) -> None:
        _check_threshold(self.threshold, "threshold")

    def active(self, components: torch.Tensor) -> torch.Tensor:
        """`(k, ...)` bool: which experts are active at each position."""
        return kl_to_base(components) > self.threshold

    def multipliers(self, components: torch.Tensor) -> torch.Tensor:
        """The exponent phase: `(k, ...)` 1 where the expert is active, 0 where it is not."""
        return self.active(components)


@dataclass(frozen=True)
class PlausibilityFilter:
    """Keep tokens that some component finds plausible (≥ alpha · its max prob, or in its top-p); phase "mask"."""

    phase: ClassVar[Literal["mask"]] = "mask"
    alpha: float | None = 0.1
    top_p: float | None = None

    def __post_init__(self) -> None:
        if self.alpha is None and self.top_p is None:
            raise ValueError("`PlausibilityFilter` needs `alpha` or `top_p`, got neither")
        _check_share(self.alpha, "alpha")
        _check_share(self.top_p, "top_p")

    def allowed(self, components: torch.Tensor) -> torch.Tensor:
        """`(..., V)` bool: the union over components of their plausible sets."""
        keep = torch.zeros(components.shape[1:], dtype=torch.bool, device=components.device)
        if self.alpha is not None:
            threshold = components.max(dim=-1, keepdim=True).values + torch.log(torch.tensor(self.alpha))
            keep |= (components >= threshold).any(0)
        if self.top_p is not None:
            sorted_logprobs, order = components.sort(dim=-1, descending=True)
            mass_before = sorted_logprobs.exp().cumsum(-1) - sorted_logprobs.exp()  # mass of better tokens
            in_nucleus = torch.zeros_like(components, dtype=torch.bool).scatter(-1, order, mass_before < self.top_p)
            keep |= in_nucleus.any(0)
        return keep


@dataclass(frozen=True)
class TerminationRule:
    """EOS takes the base's (or the active experts') log-prob instead of the composed one; phase "termination"."""

    phase: ClassVar[Literal["termination"]] = "termination"
    eos_token_id: int | Sequence[int]
    source: str = "base"
    threshold: float = 0.1  # activity threshold for source="active"

    def __post_init__(self) -> None:
        if self.source not in ("base", "active"):
            raise ValueError(f"`source` must be 'base' or 'active', got {self.source!r}")
        _check_threshold(self.threshold, "threshold")
        if not self.eos_ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.eos_ids):
            raise ValueError(
                f"`eos_token_id` must be a token id >= 0 or a non-empty list of them, got {self.eos_token_id!r}"
            )

    @property
    def eos_ids(self) -> list[int]:
        """`eos_token_id` as a list (empty if it is neither an id nor a list of them)."""
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        if isinstance(self.eos_token_id, (str, bytes)) or not isinstance(self.eos_token_id, Sequence):
            return []
        return list(self.eos_token_id)

    def eos_logprob(self, components: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
        """`(...,)` log-prob that EOS gets."""
        eos_logprobs = components.index_select(-1, eos).logsumexp(-1)  # (k+1, ...)
        if self.source == "base":
            return eos_logprobs[0]
        active = kl_to_base(components) > self.threshold  # (k, ...)
        count = active.sum(0)
        mean_active = torch.where(active, eos_logprobs[1:], 0.0).sum(0) / count.clamp(min=1)
        return torch.where(count > 0, mean_active, eos_logprobs[0])


def floored_deltas(components: torch.Tensor) -> torch.Tensor:
    """The experts' deltas `d_i = log p_i − log p_b`, each log-prob clamped to `LOGPROB_FLOOR` first.

    Args:
        components: `(k+1, ..., V)` log-probs, base first.
    Returns:
        `(k, ..., V)` finite deltas (the floor keeps -inf − -inf from being NaN, as the rule's floor does).
    """
    floored = components.clamp(min=LOGPROB_FLOOR)  # (k+1, ..., V)
    return floored[1:] - floored[0]


@dataclass(frozen=True)
class SharedDelta:
    """Count a change of log-prob that the experts share once instead of once per expert.

    Per position and token v, over the experts with a positive exponent there (`A`; a gated expert
    has exponent 0 and shares nothing), with the deltas `d_i(v) = log p_i(v) − log p_b(v)`:

        s(v) = σ · min_{i∈A} |d_i(v)|   if every d_i(v), i ∈ A, has the same sign σ ≠ 0, else 0
        log p̂ = log p_b + (max_{i∈A} w_i) · s + Σ_i w_i (d_i − [i∈A] s) − log Z

    `s` is the largest change every expert makes in the same direction (the element-wise
    minimum-magnitude agreeing component); it is applied once, at the largest weight that applies it,
    and each expert adds only its specific part `d_i − s` at its weight. With weights 1:
    `log p_b + s + Σ_i (d_i − s)`; the plain rule's scores plus `(max_{A} w_i − Σ_{A} w_i) · s`. So:

    * one expert (or one with a positive exponent): the coefficient is 0, the plain rule;
    * deltas with disjoint support (at each token at most one d_i ≠ 0): s = 0, the plain rule;
    * identical experts at weight 1: s = d, the single expert.

    The scores are computed on log-probs clamped to `LOGPROB_FLOOR`, as the rule clamps them; a token
    the plain rule rules out (-inf from a component with a positive exponent) stays ruled out. Phase "score".
    """

    phase: ClassVar[Literal["score"]] = "score"

    def scores(self, components: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
        """`(..., V)` the composed scores before renormalisation, `log p_b + (max_A w) · s + Σ_i w_i (d_i − [i∈A] s)`.

        Args:
            components: `(k+1, ..., V)` log-probs, base first.
            exponents: `(k, ...)` the experts' exponents at each position (weights times gates).
        """
        deltas = floored_deltas(components)  # (k, ..., V)
        weights = exponents.unsqueeze(-1)  # (k, ..., 1)
        sharing = weights > 0  # (k, ..., 1): the experts in A
        anyone = sharing.any(0)  # (..., 1)
        all_up = ((deltas > 0) | ~sharing).all(0) & anyone  # (..., V)
        all_down = ((deltas < 0) | ~sharing).all(0) & anyone
        magnitude = torch.where(sharing, deltas.abs(), torch.inf).amin(0)  # (..., V), inf where A is empty
        shared = torch.where(all_up, magnitude, torch.where(all_down, -magnitude, 0.0))  # (..., V)
        specific = deltas - torch.where(sharing, shared, 0.0)  # (k, ..., V): 0 for identical experts
        once = torch.where(sharing, weights, 0.0).amax(0)  # (..., 1): the largest weight in A (0 if A is empty)
        return components[0].clamp(min=LOGPROB_FLOOR) + once * shared + (weights * specific).sum(0)


@dataclass(frozen=True)
class SignConsensus:
    """TIES's trim and sign election (Yadav et al., 2023, arXiv:2306.01708), per token on log-prob deltas.

    Per position and token v, with the contributions `c_i(v) = w_i · d_i(v)`,
    `d_i = log p_i − log p_b`:

    1. trim: for each expert and position keep its k = max(1, ⌊density · V⌋) largest |d_i| over the
       vocabulary (ties with the k-th kept, as `merging.sparsify.magnitude_trim_global`), the rest 0;
    2. elect: σ(v) = sgn(Σ_i ĉ_i(v)) over the trimmed contributions (an exact 0 elects +1, as
       mergekit and peft do);
    3. keep only the trimmed contributions of sign σ(v):
       `log p̂ = log p_b + Σ_i ĉ_i [sgn ĉ_i = σ] − log Z`.

    The kept contributions are summed, as in task arithmetic, not averaged (TIES's disjoint mean). The
    sign is the contribution's, `w_i d_i`, so a negative weight votes with the change it actually
    adds. One expert, or deltas with disjoint support, with density 1: nothing is dropped, the plain
    rule. The scores are computed on log-probs clamped to `LOGPROB_FLOOR`; a token the plain rule rules
    out stays ruled out. Phase "score".
    """

    phase: ClassVar[Literal["score"]] = "score"
    density: float = 1.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.density, bool)
            or not isinstance(self.density, (int, float))
            or not (math.isfinite(self.density) and 0 < self.density <= 1)
        ):
            raise ValueError(
                f"`density` must be in (0, 1] (the fraction of each expert's deltas kept), got {self.density!r}"
            )

    def kept(self, deltas: torch.Tensor) -> torch.Tensor:
        """`(k, ..., V)` bool: the trimmed deltas, each expert's largest |d_i| at each position."""
        if self.density >= 1:
            return torch.ones_like(deltas, dtype=torch.bool)
        magnitudes = deltas.abs()  # (k, ..., V)
        count = max(1, int(self.density * deltas.shape[-1]))
        threshold = magnitudes.topk(count, dim=-1).values[..., -1:]  # (k, ..., 1): the count-th largest
        return magnitudes >= threshold

    def scores(self, components: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
        """`(..., V)` the composed scores before renormalisation, `log p_b + Σ_i ĉ_i [sgn ĉ_i = σ]`.

        Args:
            components: `(k+1, ..., V)` log-probs, base first.
            exponents: `(k, ...)` the experts' exponents at each position (weights times gates).
        """
        deltas = floored_deltas(components)  # (k, ..., V)
        contributions = exponents.unsqueeze(-1) * deltas  # (k, ..., V)
        kept = self.kept(deltas)
        trimmed = torch.where(kept, contributions, 0.0)
        elected = torch.where(trimmed.sum(0) >= 0, 1.0, -1.0)  # (..., V)
        agreeing = torch.where(trimmed * elected >= 0, trimmed, 0.0)  # (k, ..., V); zeros agree with either sign
        return components[0].clamp(min=LOGPROB_FLOOR) + agreeing.sum(0)


def compose_with_remedies(
    components: torch.Tensor,
    weights: Sequence[float] | None = None,
    remedies: Sequence[object] = (),
    validate: bool | None = None,
) -> torch.Tensor:
    """Compose `(k+1, ..., V)` component log-probs (base first) with the given remedies, after checking them.

    Without remedies this is exactly `compose_logprobs(components[0], components[1:], weights)`.
    Returns `(..., V)` float32 log-probs. `weights` must be finite and `components` must hold no NaN
    or +inf (checked before they are normalised, so the error names the input); the remedies are
    checked by `check_remedies`. `validate` is deprecated: call `compose_with_remedies_unchecked`
    for the arithmetic without the checks of values (False skipped them).
    """
    if validate is not None:
        warnings.warn(
            "`compose_with_remedies(..., validate=...)` is deprecated and will be removed in the next release; "
            "call `compose_with_remedies_unchecked` for the composition without its checks",
            DeprecationWarning,
            stacklevel=2,
        )
    if not isinstance(components, torch.Tensor) or components.dim() < 2:
        raise ValueError(
            "`components` must be a (k+1, ..., V) tensor of logits or log-probs, base first, got "
            + (
                f"shape {tuple(components.shape)}"
                if isinstance(components, torch.Tensor)
                else type(components).__name__
            )
        )
    weights = check_weights(weights, components.shape[0] - 1)
    if validate is False:
        check_remedies(remedies, components.shape[-1])
        return apply_phases(components, weights, remedies, _rule_with_argument_checks)
    check_scores(components, "`components` (index 0 is the base, then the experts)")
    check_remedies(remedies, components.shape[-1])
    return apply_phases(components, weights, remedies, compose_logprobs)


def compose_with_remedies_unchecked(
    components: torch.Tensor, weights: Sequence[float] | None = None, remedies: Sequence[object] = ()
) -> torch.Tensor:
    """`compose_with_remedies` without its checks and host syncs, for a decoding loop.

    For `components` built to fit, finite `weights` and remedies checked once (`check_remedies`);
    a position where every token is ruled out comes out NaN."""
    return apply_phases(components, weights, remedies, compose_logprobs_unchecked)


def step_composer(
    weights: Sequence[float] | None, remedies: Sequence[object], vocab_size: int, checked: bool
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The composition of every step of a decoding loop, `(k+1, ..., V)` -> `(..., V)`; the remedies checked once.

    `checked` (sampling: NaN must not reach the sampler) composes with `compose_with_remedies`' checks;
    otherwise without, and the loop looks for NaN in the composed scores itself."""
    check_remedies(remedies, vocab_size)
    rule = compose_with_remedies if checked else compose_with_remedies_unchecked
    return partial(rule, weights=weights, remedies=remedies)


def check_remedies(remedies: Sequence[object], vocab_size: int) -> None:
    """Refuse what is not a remedy (`remedy_phase`: no phase, or without its phase's method), more than one
    remedy of the score phase (`SharedDelta`, `SignConsensus` or a user's) or of the termination phase, and an EOS
    id outside the vocabulary."""
    if isinstance(remedies, (str, bytes)) or not isinstance(remedies, Sequence):
        raise ValueError(f"`remedies` must be a list of remedies, got {type(remedies).__name__}")
    for remedy in remedies:
        try:
            remedy_phase(remedy)
        except ValueError as error:
            raise ValueError(
                f"unknown remedy {remedy!r}; allowed: "
                + ", ".join(kind.__name__ for kind in _REMEDY_TYPES)
                + f", or an object of your own that implements a phase ({error})"
            ) from None
    phases = by_phase(remedies)
    if len(phases["score"]) > 1:
        raise ValueError(
            "at most one of SharedDelta and SignConsensus can be given (or one score-phase remedy of your own: each "
            f"replaces how the deltas add up), got {', '.join(map(repr, phases['score']))}"
        )
    if len(phases["termination"]) > 1:
        raise ValueError(
            f"at most one TerminationRule (or termination-phase remedy) can be given, got {len(phases['termination'])}"
        )
    for termination in phases["termination"]:
        eos_ids = termination.eos_ids  # type: ignore[attr-defined]
        if not eos_ids or not all(_token_id(i) and i < vocab_size for i in eos_ids):
            if isinstance(termination, TerminationRule):
                name, value = "TerminationRule.eos_token_id", termination.eos_token_id
            else:
                name, value = f"{type(termination).__name__}.eos_ids", eos_ids
            raise ValueError(f"`{name}` must be below the vocabulary size {vocab_size}, got {value!r}")


def _token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_REMEDY_TYPES = (ActivityGate, SharedDelta, SignConsensus, PlausibilityFilter, TerminationRule)


def _rule_with_argument_checks(
    base: torch.Tensor, experts: Sequence[torch.Tensor], weights: torch.Tensor | None
) -> torch.Tensor:
    """The rule as `compose_with_remedies(validate=False)` ran it: arguments checked, values not."""
    check_composition_arguments(base, experts, weights)
    return compose_logprobs_unchecked(base, experts, weights)


class RemedySettings(BaseModel):
    """One combination of remedies (at least one).

    * `gate`: `ActivityGate(threshold)`, in nats of `KL(p_i ‖ p_b)`;
    * `plausibility_alpha` / `plausibility_top_p`: `PlausibilityFilter(alpha, top_p)`;
    * `termination`: `TerminationRule(eos, source)`, "base" or "active" (with
      `termination_threshold` as the activity threshold of "active");
    * `shared_delta: true`: `SharedDelta()`, a change the experts share counted once;
    * `sign_consensus: true`: `SignConsensus(sign_consensus_density)`, TIES's trim and sign election per token
      (`sign_consensus_density` 1, the default, trims nothing). At most one of the two;
    * `custom`: remedies of your own, each `{class: package.module:Name, its parameters...}`
      (`mergecompose.composition.remedy_imports.ImportedRemedy`), after the built-ins in their phases. A set
      of one such remedy can be written as its entry alone: `{class: my_package.remedies:Temper, alpha: 0.5}`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    gate: float | None = Field(None, ge=0)
    plausibility_alpha: float | None = Field(None, gt=0, le=1)
    plausibility_top_p: float | None = Field(None, gt=0, le=1)
    termination: Literal["base", "active"] | None = None
    termination_threshold: float = Field(0.1, ge=0)
    # Left out of dumps at their defaults, so that configs without them keep their hashes and round-trip.
    shared_delta: bool = Field(False, exclude_if=lambda value: not value)
    sign_consensus: bool = Field(False, exclude_if=lambda value: not value)
    sign_consensus_density: float = Field(1.0, gt=0, le=1, exclude_if=lambda value: value == 1.0)
    custom: tuple[ImportedRemedy, ...] = Field((), exclude_if=lambda value: not value)

    @model_validator(mode="before")
    @classmethod
    def _one_remedy_of_your_own(cls, data: Any) -> Any:
        """`{class: PATH, ...}` alone is the set `{custom: [{class: PATH, ...}]}`."""
        if isinstance(data, Mapping) and CLASS_KEY in data:
            return {"custom": [data]}
        return data

    @model_validator(mode="after")
    def _something(self) -> RemedySettings:
        if (
            self.gate is None
            and self.plausibility_alpha is None
            and self.plausibility_top_p is None
            and self.termination is None
            and not self.shared_delta
            and not self.sign_consensus
            and not self.custom
        ):
            raise ValueError(
                "a remedy set needs at least one of `gate`, `plausibility_alpha`, `plausibility_top_p`, `termination`, "
                "`shared_delta`, `sign_consensus`, or a remedy of your own (`class: package.module:Name`)"
            )
        if self.shared_delta and self.sign_consensus:
            raise ValueError("give `shared_delta` or `sign_consensus`, not both (each replaces how the deltas add up)")
        if self.sign_consensus_density != 1.0 and not self.sign_consensus:
            raise ValueError(
                f"`sign_consensus_density` ({self.sign_consensus_density}) needs `sign_consensus: true`, "
                "which is not set"
            )
        return self

    @classmethod
    def parse(cls, text: str) -> RemedySettings:
        """The string form used where a mapping cannot go (lm-eval's `model_args`):
        `name:value` pairs of these fields joined by `;`, e.g. `gate:0.1;termination:base`. A remedy of your
        own is `class:package.module:Name` followed by its parameters, each value read as YAML
        (`gate:0.1;class:my_package.remedies:Temper;alpha:0.5`): the pairs after a `class` are its own."""
        values: dict[str, Any] = {}
        custom: list[dict[str, Any]] = []
        for part in filter(None, (piece.strip() for piece in text.split(";"))):
            name, separator, value = part.partition(":")
            if not separator or not name.strip() or not value.strip():
                raise ValueError(
                    f"`remedies` must be `field:value` pairs joined by ';' (fields: {sorted(cls.model_fields)}, or "
                    f"`{CLASS_KEY}:package.module:Name` and its parameters), got {text!r}"
                )
            name, value = name.strip(), value.strip()
            if name == CLASS_KEY:
                custom.append({CLASS_KEY: value})
            elif custom:
                custom[-1][name] = yaml_scalar(value)
            else:
                values[name] = value
        if custom:
            values["custom"] = custom
        try:
            return cls.model_validate(values)
        except ValidationError as error:
            raise ValueError(f"`remedies` {text!r}: {validation_message(error)}") from None

    def as_model_args(self) -> str:
        """The string form `parse` reads: the fields set, then each remedy of your own as `class:PATH` and its
        parameters (values as JSON, which `parse` reads as YAML). Refuses a value holding `;` or `,`, which
        lm-eval's `model_args` cannot carry."""
        pairs = [f"{key}:{value}" for key, value in self.model_dump(exclude_none=True, exclude={"custom"}).items()]
        for imported in self.custom:
            pairs.append(f"{CLASS_KEY}:{imported.path}")
            pairs.extend(f"{name}:{json.dumps(value)}" for name, value in imported.params.items())
        text = ";".join(pairs)
        for pair in pairs:
            if any(mark in pair.partition(":")[2] for mark in ";,"):
                raise ValueError(f"`remedies`: {pair!r} holds ';' or ',', which lm-eval's `model_args` cannot carry")
        return text

    def build(self, eos_token_id: int) -> list:
        """The `mergecompose.composition.remedies` objects, for `ComposedLM(..., remedies=...)`."""
        remedies: list = []
        if self.gate is not None:
            remedies.append(ActivityGate(self.gate))
        if self.shared_delta:
            remedies.append(SharedDelta())
        if self.sign_consensus:
            remedies.append(SignConsensus(self.sign_consensus_density))
        if self.plausibility_alpha is not None or self.plausibility_top_p is not None:
            remedies.append(PlausibilityFilter(alpha=self.plausibility_alpha, top_p=self.plausibility_top_p))
        if self.termination is not None:
            remedies.append(
                TerminationRule(eos_token_id, source=self.termination, threshold=self.termination_threshold)
            )
        remedies.extend(imported.build(eos_token_id) for imported in self.custom)
        return remedies
