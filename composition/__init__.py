"""Probability-space composition: log p̂ = log p_b + Σ_i w_i (log p_i − log p_b), renormalised."""

from mergecompose.composition.decoding_config import DecodingConfig
from mergecompose.composition.model import ComposedLM
from mergecompose.composition.remedies import (
    ActivityGate,
    PlausibilityFilter,
    RemedySettings,
    TerminationRule,
    compose_with_remedies,
    compose_with_remedies_unchecked,
)
from mergecompose.composition.remedy_phases import (
    PHASES,
    ExponentRemedy,
    MaskRemedy,
    ScoreRemedy,
    TerminationRemedy,
)
from mergecompose.composition.rule import check_composition, compose_logprobs, compose_logprobs_unchecked
from mergecompose.composition.speculative.acceptance import outcome_probabilities
from mergecompose.composition.speculative.decoding import SpeculationStats

__all__ = [
    "PHASES",
    "ActivityGate",
    "ComposedLM",
    "DecodingConfig",
    "ExponentRemedy",
    "MaskRemedy",
    "PlausibilityFilter",
    "RemedySettings",
    "ScoreRemedy",
    "SpeculationStats",
    "TerminationRemedy",
    "TerminationRule",
    "check_composition",
    "compose_logprobs",
    "compose_logprobs_unchecked",
    "compose_with_remedies",
    "compose_with_remedies_unchecked",
    "outcome_probabilities",
]
