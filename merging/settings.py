"""The resolved, validated parameters of one merge, as a typed (pydantic) record.

Every merge method resolves the keywords it was called with into a `MergeSettings`: defaults
filled in from the definition it follows, every value checked. The record is what `merge(...,
out_dir=...)` writes next to its output, and what a YAML file can hold.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict

Consensus = Literal["paper", "mergekit"]
TrimScope = Literal["global", "per_tensor"]
SignElection = Literal["mass", "count"]
Rescale = Literal["inverse", "l1"]

CONSENSUS_VALUES = ("paper", "mergekit")
TRIM_SCOPES = ("global", "per_tensor")
SIGN_ELECTIONS = ("mass", "count")
RESCALES = ("inverse", "l1")


class MergeSettings(BaseModel):
    """One merge, fully resolved. Fields that do not apply to the method are None."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str
    weights: list[float]
    normalize: bool
    lam: float | None = None
    density: float | None = None
    drop_rate: float | None = None
    gamma: float | None = None
    seed: int | None = None
    consensus: Consensus | None = None
    sign_election: SignElection | None = None
    trim_scope: TrimScope | None = None
    rescale: Rescale | None = None


def check_choice(name: str, value, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {list(allowed)}, got {value!r}")
    return value


def check_real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite real number, got {value!r}")
    return float(value)


def check_density(value, name: str = "density") -> float:
    value = check_real(name, value)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"`{name}` must be in (0, 1], got {value}")
    return value


def check_drop_rate(value) -> float:
    value = check_real("drop_rate", value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"`drop_rate` must be in [0, 1), got {value}")
    return value


def check_gamma(value) -> float:
    value = check_real("gamma", value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"`gamma` must be in [0, 1), got {value}")
    return value


def check_seed(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`seed` must be a non-negative integer, got {value!r}")
    return value


def check_weights(weights, count: int) -> list[float]:
    """One finite real weight per input; None means 1.0 each."""
    if weights is None:
        return [1.0] * count
    if isinstance(weights, (str, bytes)) or not hasattr(weights, "__len__"):
        raise ValueError(f"`weights` must be a sequence of {count} numbers, got {weights!r}")
    weights = [float(w) if hasattr(w, "item") else w for w in weights]
    if len(weights) != count:
        raise ValueError(f"`weights` must hold one weight per input ({count}), got {len(weights)}")
    return [check_real(f"weights[{index}]", weight) for index, weight in enumerate(weights)]
