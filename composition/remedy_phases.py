"""The remedy protocol: what a remedy is, in which phase it acts, and the one function that applies the phases.

A remedy changes the composition rule at every decoding step. It declares its **phase** (a class
attribute `phase`) and implements that phase's one method; the built-ins of
`mergecompose.composition.remedies` are ordinary implementations, and a user's remedy is any object that
does the same (found by an import path in configs and on the command line,
`mergecompose.composition.remedy_imports`). The phases run in this fixed order around the rule
`log p̂ = log p_b + Σ_i e_i (log p_i − log p_b) − log Z`:

1. **exponent** (`ExponentRemedy.multipliers`): `(k, ...)` per-expert, per-position multipliers of the
   exponents, `e_i = w_i · Π_gates m_i` (a gate returns 0/1, e.g. `ActivityGate`). Then the rule runs.
2. **score** (`ScoreRemedy.scores`): the composed scores before renormalisation, from the components and
   the exponents, replacing the rule's (`SharedDelta`, `SignConsensus`). At most one: each replaces how
   the deltas add up. A token the rule rules out stays ruled out.
3. **mask** (`MaskRemedy.allowed`): `(..., V)` the tokens kept; the others get -inf and the rest is
   renormalised (`PlausibilityFilter`).
4. **termination** (`TerminationRemedy.eos_logprob`): the log-prob the EOS ids get together; the other
   tokens keep their relative composed probabilities and share the rest (`TerminationRule`). At most one.

Within a phase, remedies apply in the order given. Every method takes `components`, the `(k+1, ..., V)`
float32 log-probs of the base (index 0) and the experts at the positions being scored, and returns
tensors of the shapes above. **A remedy is stateless**: its result is a function of its arguments alone,
with nothing kept from one call to the next (no step counter, no history), and it must not change its
inputs. The same positions may be scored more than once, in batches of any size: by speculative decoding
(the draft's tokens are re-scored, and exactness rests on the target being this function of the
components), by a rejected step, by `score` and by `generate`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar, Literal, Protocol, runtime_checkable

import torch

Phase = Literal["exponent", "score", "mask", "termination"]
# The fixed order; the rule runs between "exponent" and "score".
PHASES: tuple[Phase, ...] = ("exponent", "score", "mask", "termination")
# What each phase asks of a remedy: the method (or attribute) the phase calls.
PHASE_METHODS: dict[str, tuple[str, ...]] = {
    "exponent": ("multipliers",),
    "score": ("scores",),
    "mask": ("allowed",),
    "termination": ("eos_ids", "eos_logprob"),
}


@runtime_checkable
class ExponentRemedy(Protocol):
    """Multiplies the experts' exponents, per expert and position (a gate)."""

    phase: ClassVar[Literal["exponent"]]

    def multipliers(self, components: torch.Tensor) -> torch.Tensor:
        """`(k, ...)` bool or float: what each expert's exponent is multiplied by at each position."""
        ...


@runtime_checkable
class ScoreRemedy(Protocol):
    """Replaces the rule's composed scores (before renormalisation)."""

    phase: ClassVar[Literal["score"]]

    def scores(self, components: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
        """`(..., V)` scores from the components and the `(k, ...)` exponents (weights times gates)."""
        ...


@runtime_checkable
class MaskRemedy(Protocol):
    """Keeps a set of tokens; the others are ruled out."""

    phase: ClassVar[Literal["mask"]]

    def allowed(self, components: torch.Tensor) -> torch.Tensor:
        """`(..., V)` bool: the tokens kept at each position."""
        ...


@runtime_checkable
class TerminationRemedy(Protocol):
    """Sets the log-prob of the end-of-sequence ids, trading mass with the other tokens."""

    phase: ClassVar[Literal["termination"]]

    @property
    def eos_ids(self) -> list[int]:
        """The end-of-sequence token ids."""
        ...

    def eos_logprob(self, components: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
        """`(...,)` the log-prob the ids `eos` (a 1-D tensor of `eos_ids`) get together."""
        ...


def remedy_phase(remedy: object) -> Phase:
    """The phase `remedy` declares, after checking that it implements that phase's method.

    Raises:
        ValueError: a class given instead of an instance; no `phase`, or one that is not a phase; the
            phase's method (or `eos_ids`) missing or not callable.
    """
    if isinstance(remedy, type):
        raise ValueError(f"a remedy must be an instance, got the class {remedy.__name__}; give {remedy.__name__}(...)")
    phase = getattr(remedy, "phase", None)
    name = type(remedy).__name__
    if phase not in PHASES:
        declared = "declares no phase" if phase is None else f"declares phase {phase!r}, which is not one"
        raise ValueError(
            f"remedy {name} {declared}: a remedy needs a class attribute `phase`, one of {', '.join(PHASES)}"
        )
    for method in PHASE_METHODS[phase]:
        attribute = getattr(remedy, method, None)
        if attribute is None or (method != "eos_ids" and not callable(attribute)):
            kind = "attribute" if method == "eos_ids" else "method"
            raise ValueError(
                f"remedy {name} declares phase {phase!r} but has no {kind} `{method}`; a {phase} remedy implements "
                + " and ".join(f"`{needed}`" for needed in PHASE_METHODS[phase])
            )
    return phase


def by_phase(remedies: Sequence[object]) -> dict[Phase, list[object]]:
    """The remedies of each phase, in the order given (each checked by `remedy_phase`)."""
    grouped: dict[Phase, list[object]] = {phase: [] for phase in PHASES}
    for remedy in remedies:
        grouped[remedy_phase(remedy)].append(remedy)
    return grouped


# The rule the phases wrap: base `(..., V)`, experts, exponents `(k, ...)` or None -> `(..., V)` log-probs.
Rule = Callable[[torch.Tensor, Sequence[torch.Tensor], torch.Tensor | None], torch.Tensor]


def apply_phases(
    components: torch.Tensor, weights: Sequence[float] | None, remedies: Sequence[object], rule: Rule
) -> torch.Tensor:
    """Compose `(k+1, ..., V)` components (base first) by `rule`, with the remedies' phases in their order.

    Returns `(..., V)` float32 log-probs. Nothing is checked here but each remedy's phase (the callers
    check the values and the remedies once)."""
    phases = by_phase(remedies)
    components = torch.log_softmax(components.float(), dim=-1)  # (k+1, ..., V)
    k = components.shape[0] - 1

    exponents = None
    if weights is not None or phases["exponent"]:
        exponents = torch.ones(k, *components.shape[1:-1], device=components.device)  # (k, ...)
        if weights is not None:
            exponents = exponents * torch.as_tensor(weights, dtype=torch.float32, device=components.device).reshape(
                k, *([1] * (components.dim() - 2))
            )
        for gate in phases["exponent"]:
            exponents = exponents * gate.multipliers(components)  # type: ignore[attr-defined]

    composed = rule(components[0], list(components[1:]), exponents)  # (..., V)

    for score_rule in phases["score"]:
        # The rule's result says which tokens a component with a positive exponent rules out (and checks it).
        expert_exponents = exponents if exponents is not None else torch.ones_like(components[1:, ..., 0])  # (k, ...)
        scores = score_rule.scores(components, expert_exponents)  # type: ignore[attr-defined]  # (..., V)
        composed = torch.log_softmax(scores.masked_fill(torch.isneginf(composed), float("-inf")), dim=-1)

    for mask in phases["mask"]:
        allowed = mask.allowed(components)  # type: ignore[attr-defined]  # (..., V)
        composed = torch.log_softmax(composed.masked_fill(~allowed, float("-inf")), dim=-1)

    for termination in phases["termination"]:
        composed = _trade_eos(composed, components, termination)
    return composed


def _trade_eos(composed: torch.Tensor, components: torch.Tensor, termination: object) -> torch.Tensor:
    """EOS gets `termination.eos_logprob`; the other tokens keep their relative composed probabilities."""
    eos = torch.as_tensor(termination.eos_ids, device=components.device).reshape(-1)  # type: ignore[attr-defined]
    target = termination.eos_logprob(components, eos)  # type: ignore[attr-defined]  # (...,)
    is_eos = torch.zeros(components.shape[-1], dtype=torch.bool, device=components.device)
    is_eos[eos] = True
    # Non-EOS tokens keep their relative composed probabilities and share 1 − p_eos.
    rest = torch.log_softmax(composed.masked_fill(is_eos, float("-inf")), dim=-1)  # (..., V)
    rest = rest + torch.log1p(-target.exp().clamp(max=1 - 1e-7)).unsqueeze(-1)
    eos_mass = composed.index_select(-1, eos).logsumexp(-1, keepdim=True)  # (..., 1)
    eos_share = composed.index_select(-1, eos) - eos_mass
    adjusted = rest.clone()
    adjusted[..., eos] = eos_share + target.unsqueeze(-1)  # EOS ids split `target` as the composition did
    # Where a mask left only EOS, or ruled EOS out, there is nothing to trade between EOS and the rest:
    # the masked distribution stays as it is (no 0/0 NaN).
    rest_mass = composed.masked_fill(is_eos, float("-inf")).logsumexp(-1, keepdim=True)
    tradeable = torch.isfinite(eos_mass) & torch.isfinite(rest_mass)  # (..., 1)
    return torch.where(tradeable, adjusted, composed)
