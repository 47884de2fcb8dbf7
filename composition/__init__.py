"""Probability-space composition: log p̂ = log p_b + Σ_i w_i (log p_i − log p_b), renormalised."""

from mergecompose.composition.model import ComposedLM
from mergecompose.composition.remedies import (
    ActivityGate,
    PlausibilityFilter,
    RemedySettings,
    TerminationRule,
    compose_with_remedies,
)
from mergecompose.composition.rule import compose_logprobs
from mergecompose.composition.speculative import SpeculationStats, outcome_probabilities

__all__ = [
    "ActivityGate",
    "ComposedLM",
    "PlausibilityFilter",
    "RemedySettings",
    "SpeculationStats",
    "TerminationRule",
    "compose_logprobs",
    "compose_with_remedies",
    "outcome_probabilities",
]
