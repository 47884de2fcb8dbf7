"""Task arithmetic, TIES, DARE and their kin as configured variants of one general method.

    θ = θ_base + λ · merge_i( w_i, sparsify(τ_i) )

1. sparsify each task vector τ_i: none, magnitude trim (TIES), random drop (DARE) or outlier
   trim (Breadcrumbs);
2. optionally elect a sign per entry and keep only the entries that agree with it (TIES);
3. sum the weighted entries, optionally divided (normalize=True) by the count or the summed
   weight of the entries that contributed;
4. scale by λ and add to the base.

Where the definitions differ (the choices are keywords of `merge`):

* consensus="paper" (default): the sign is elected on the unweighted trimmed task vectors,
  γ = sgn(Σ_i τ̂_i) (TIES paper, eq. 2; `sign_election="count"` uses sgn(Σ_i sgn τ̂_i)), and the
  disjoint mean divides Σ_{i agrees} w_i τ̂_i by the *count* of agreeing non-zero entries. The paper
  has no per-task weights; with all w_i = 1 this is its algorithm. peft's `merge_utils.ties` /
  `dare_ties` compute the same (with trim_scope="per_tensor").
* consensus="mergekit": the weights are applied *before* the election, γ = sgn(Σ_i w_i τ̂_i), and
  the mean divides by the *sum of the weights* of the agreeing entries (mergekit's
  `GeneralizedTaskArithmeticMerge`).
* trim_scope="global" (the TIES paper) or "per_tensor" (mergekit, peft); see `sparsify.magnitude_trim`.
* rescale="inverse" (DARE paper, peft: 1/(1 − p)) or "l1" (mergekit); see `sparsify.random_drop`.

Exact zero sums elect +1 (as mergekit and peft do; the TIES reference code assigns the overall
majority sign there). Tensors are merged one name at a time; a name missing from some task
vectors counts as zero for them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from mergekit.merge_methods.generalized_task_arithmetic import get_mask
from tqdm.auto import tqdm

from mergecompose.merging.method_settings import (
    BreadcrumbsSettings,
    DareLinearSettings,
    MagnitudePruneSettings,
    NamedBySettings,
    TaskArithmeticSettings,
)
from mergecompose.merging.sparsify import magnitude_trim, magnitude_trim_global, outlier_trim, random_drop

# mergekit's names for the two sign elections.
_MERGEKIT_ELECTION = {"mass": "sum", "count": "count"}


@dataclass(frozen=True)
class GeneralizedTaskArithmetic(NamedBySettings):
    """One configured variant: its settings model, which sparsification, whether to elect signs.

    settings: the pydantic model of its parameters and defaults (`mergecompose.merging.method_settings`).
    sparsification: None | "magnitude" | "random" | "outliers".
    sign_consensus: elect a sign per entry and average only agreeing entries (TIES).
    mergekit: mergekit runs the same merge under the same name (`merge_checkpoints` offers it).
    """

    settings: type[TaskArithmeticSettings]
    sparsification: str | None
    sign_consensus: bool
    reference: str
    mergekit: bool

    def __call__(
        self,
        base: Mapping[str, torch.Tensor],
        task_vectors: Sequence[Mapping[str, torch.Tensor]],
        settings: TaskArithmeticSettings,
        progress: bool = False,
    ) -> dict[str, torch.Tensor]:
        """The merged tensors θ_base + λ · merged delta, for every name some task vector holds.

        Returns tensors in the task vectors' dtype (float32, or float64); `merge` casts them back.
        Random drops are drawn name by name, and for each name task vector by task vector, from
        one generator seeded with `settings.seed` (the order in which peft and mergekit draw).
        """
        if self.sparsification == "magnitude" and settings.trim_scope == "global":
            density = cast(MagnitudePruneSettings, settings).density
            task_vectors = [magnitude_trim_global(task_vector, density) for task_vector in task_vectors]
        generator: torch.Generator | None = None
        names = list(dict.fromkeys(name for task_vector in task_vectors for name in task_vector))
        result = {}
        for name in tqdm(names, desc=f"{self.name} merge", disable=not progress, leave=False):
            present = next(task_vector[name] for task_vector in task_vectors if name in task_vector)
            if self.sparsification == "random" and generator is None:
                generator = torch.Generator(device=present.device).manual_seed(settings.seed)
            deltas = [
                self._sparsify(task_vector[name], settings, generator)
                if name in task_vector
                else torch.zeros_like(present)
                for task_vector in task_vectors
            ]
            stacked = torch.stack(deltas)  # (k, *shape)
            weights = torch.tensor(settings.weights, dtype=stacked.dtype, device=stacked.device)  # (k,)
            delta = self.merge_deltas(stacked, weights, settings)  # (*shape)
            if settings.lam != 1.0:
                delta = delta * settings.lam
            result[name] = base[name].to(device=delta.device, dtype=delta.dtype) + delta
        return result

    def _sparsify(
        self, tensor: torch.Tensor, settings: TaskArithmeticSettings, generator: torch.Generator | None
    ) -> torch.Tensor:
        # Each sparsification comes with its settings model (the registry pairs them).
        if self.sparsification == "magnitude" and settings.trim_scope == "per_tensor":
            return magnitude_trim(tensor, cast(MagnitudePruneSettings, settings).density)
        if self.sparsification == "outliers":
            breadcrumbs = cast(BreadcrumbsSettings, settings)
            return outlier_trim(tensor, breadcrumbs.density, breadcrumbs.gamma)
        if self.sparsification == "random":
            dare = cast(DareLinearSettings, settings)
            # Validation sets drop_rate; `__call__` seeds the generator before the first random drop.
            return random_drop(tensor, cast(float, dare.drop_rate), dare.rescale, cast(torch.Generator, generator))
        return tensor  # no sparsification, or already trimmed globally

    def merge_deltas(
        self, stacked: torch.Tensor, weights: torch.Tensor, settings: TaskArithmeticSettings
    ) -> torch.Tensor:
        """Merge k sparsified deltas of one tensor: (k, *shape) -> (*shape). Weights: (k,)."""
        weights = weights.reshape(-1, *([1] * (stacked.dim() - 1)))  # (k, 1, ..., 1)
        weighted = stacked * weights  # (k, *shape)
        if not self.sign_consensus:
            merged = weighted.sum(dim=0)
            return merged / weights.sum() if settings.normalize else merged
        election = _MERGEKIT_ELECTION[settings.sign_election]
        if settings.consensus == "paper":
            agrees = get_mask(stacked, method=election)  # sign elected on unweighted τ̂_i
            contributors = agrees.to(stacked.dtype)  # divide by the count
        else:
            agrees = get_mask(weighted, method=election)  # sign elected on w_i τ̂_i
            contributors = weights * agrees  # divide by the summed weight
        merged = (weighted * agrees).sum(dim=0)
        if not settings.normalize:
            return merged
        divisor = contributors.sum(dim=0)
        divisor[divisor == 0] = 1
        return merged / divisor
