"""A user's own remedies, outside the package, as a user's project would hold them.

The tests name them by import path (`user_remedies:BaseTopK`); `tests/conftest.py` puts this folder on
`sys.path`, as a user's project is on theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class BaseTopK:
    """Mask phase: keep only the base's `k` likeliest tokens (ties with the k-th kept)."""

    phase: ClassVar[str] = "mask"
    k: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"`k` must be an integer >= 1, got {self.k!r}")

    def allowed(self, components: torch.Tensor) -> torch.Tensor:
        base = components[0]  # (..., V)
        kth = base.topk(self.k, dim=-1).values[..., -1:]  # (..., 1)
        return base >= kth


@dataclass(frozen=True)
class Scale:
    """Exponent phase: every expert's exponent times `alpha` (so the rule at weights `alpha · w`)."""

    phase: ClassVar[str] = "exponent"
    alpha: float = 0.5

    def multipliers(self, components: torch.Tensor) -> torch.Tensor:
        return torch.full(components.shape[:-1], self.alpha)[1:]  # (k, ...)


class LogitsPhase:
    """Declares a phase that does not exist."""

    phase = "logits"

    def allowed(self, components: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(components[0], dtype=torch.bool)


class NoMethod:
    """Declares the mask phase without its method."""

    phase = "mask"
