"""The thresholds and sizes of the overlap diagnostics, checked once when they are made."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class OverlapSettings(BaseModel):
    """Thresholds and sizes of the overlap diagnostics.

    * `epsilon`: the activity threshold (nats) for `A_t(ε)` used in the headline numbers, and
      the delta threshold for the supports `S_i`;
    * `epsilons`: the thresholds at which co-activation and active fractions are also reported;
    * `eta`: the probability floor of the supports;
    * `reservoir_size`, `top_k`: example positions kept for the report and the tokens shown
      for each; `heatmap_sequences`: sequences whose per-position activity is kept for the plot;
    * `top_tokens`: per expert, how many of the tokens with the largest mean |δ̃| are listed;
    * `centre`: how each delta is centred over the vocabulary before the overlap
      (`mergecompose.analysis.delta_overlap.centred_deltas`): "base_weighted_median" (the default: set by where
      the base's mass is, and cheap to find on the top-k union) or "median" (each token counted
      once; a selection over V per position);
    * `full_vocabulary`: compute the centre, supports, overlap sums, top tokens and restricted
      projective error over all V tokens at every position. By default (False) they are computed
      on the `candidates` tokens U with the largest max(p_b, p_i…, q) at each position (the union
      of each one's top tokens), and the report gives the mass outside U (`vocabulary`) and
      bounds on each pair's mass overlap;
    * `seed`: the reservoir's random generator.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    epsilon: float = Field(0.1, ge=0)
    epsilons: list[float] = Field(default_factory=lambda: [0.01, 0.1, 1.0])
    eta: float = Field(1e-3, ge=0, lt=1)
    reservoir_size: int = Field(16, ge=0)
    top_k: int = Field(5, ge=1)
    heatmap_sequences: int = Field(8, ge=0)
    top_tokens: int = Field(10, ge=0)
    centre: Literal["median", "base_weighted_median"] = "base_weighted_median"
    full_vocabulary: bool = False
    candidates: int = Field(256, ge=1)
    seed: int = 0

    @field_validator("epsilons")
    @classmethod
    def _non_negative(cls, values: list[float]) -> list[float]:
        if not values or any(not v >= 0 for v in values):
            raise ValueError(f"`epsilons` must be a non-empty list of values >= 0, got {values}")
        return sorted(set(float(v) for v in values))
