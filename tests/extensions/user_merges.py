"""A user's merge methods, outside the package, for tests/merging/test_user_merge_method.py.

Named by import path (`user_merges:largest_task_vector`) once this folder is on `sys.path`; nothing here
registers anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from pydantic import Field

from mergecompose.merging import MergeSettings


class LargestSettings(MergeSettings):
    """λ scales the one task vector kept per tensor; `norm_p` is the p of the norm that picks it."""

    lam: float = Field(1.0, gt=0, description="λ > 0, the scale of the kept task vector")
    norm_p: float = Field(2.0, ge=1, description="p >= 1 of the norm ‖w_i τ_i‖_p that picks the task vector")


def largest_task_vector(
    base: Mapping[str, torch.Tensor],
    task_vectors: Sequence[Mapping[str, torch.Tensor]],
    settings: LargestSettings,
) -> dict[str, torch.Tensor]:
    """θ = θ_base + λ · w_j τ_j per tensor, where j maximises ‖w_i τ_i‖_p (the first on ties)."""
    merged = {}
    for name, base_tensor in base.items():
        weighted = [weight * tv[name] for weight, tv in zip(settings.weights, task_vectors) if name in tv]
        if weighted:
            largest = max(weighted, key=lambda delta: delta.norm(p=settings.norm_p).item())  # (*shape)
            merged[name] = base_tensor + settings.lam * largest
    return merged


class LargestTaskVector:
    """The same method as an object of the `MergeMethod` protocol, named by its class."""

    settings = LargestSettings

    def __call__(self, base, task_vectors, settings, progress=False):
        return largest_task_vector(base, task_vectors, settings)


class NoSettings:
    """Callable, but with no settings model: not a merge method."""

    def __call__(self, base, task_vectors, settings):
        return dict(base)


def untyped(base, task_vectors, settings):
    """A function whose settings parameter has no annotation: not a merge method."""
    return dict(base)
