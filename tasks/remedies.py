"""Remedies for composing many experts, as typed config: each named set becomes a system `compose+<name>`.

A compare config may list remedy sets under `remedies:`:

    remedies:
      gate: {gate: 0.1}                       # ActivityGate(threshold=0.1)
      plausible: {plausibility_alpha: 0.1}    # PlausibilityFilter(alpha=0.1)
      eos_base: {termination: base}           # TerminationRule(eos, source="base")
      all: {gate: 0.1, plausibility_alpha: 0.1, termination: base}

The remedies themselves live in `composition.remedies`; this only names and builds them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from composition import ActivityGate, PlausibilityFilter, TerminationRule


class RemedySettings(BaseModel):
    """One combination of remedies (at least one).

    * `gate`: `ActivityGate(threshold)`, in nats of `KL(p_i ‖ p_b)`;
    * `plausibility_alpha` / `plausibility_top_p`: `PlausibilityFilter(alpha, top_p)`;
    * `termination`: `TerminationRule(eos, source)`, "base" or "active" (with
      `termination_threshold` as the activity threshold of "active").
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    gate: float | None = Field(None, ge=0)
    plausibility_alpha: float | None = Field(None, gt=0, le=1)
    plausibility_top_p: float | None = Field(None, gt=0, le=1)
    termination: Literal["base", "active"] | None = None
    termination_threshold: float = Field(0.1, ge=0)

    @model_validator(mode="after")
    def _something(self):
        if self.gate is None and self.plausibility_alpha is None and self.plausibility_top_p is None and self.termination is None:
            raise ValueError(
                "a remedy set needs at least one of `gate`, `plausibility_alpha`, `plausibility_top_p`, `termination`"
            )
        return self

    def build(self, eos_token_id: int) -> list:
        """The `composition.remedies` objects, for `ComposedLM(..., remedies=...)`."""
        remedies: list = []
        if self.gate is not None:
            remedies.append(ActivityGate(self.gate))
        if self.plausibility_alpha is not None or self.plausibility_top_p is not None:
            remedies.append(PlausibilityFilter(alpha=self.plausibility_alpha, top_p=self.plausibility_top_p))
        if self.termination is not None:
            remedies.append(TerminationRule(eos_token_id, source=self.termination, threshold=self.termination_threshold))
        return remedies


def remedy_system_name(name: str) -> str:
    return f"compose+{name}"
