"""Probability-space composition: log p̂ = log p_b + Σ_i w_i (log p_i − log p_b), renormalised."""

from composition.model import ComposedLM
from composition.rule import compose_logprobs

__all__ = ["ComposedLM", "compose_logprobs"]
