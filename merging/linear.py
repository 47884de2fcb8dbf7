"""Linear merge (weight averaging, "model soups": Wortsman et al., 2022, arXiv:2203.05482).

    θ = Σ_i w_i θ_i / Σ_i w_i          (normalize=True, the default, as in mergekit)
    θ = Σ_i w_i θ_i                    (normalize=False)

The fine-tuned models are averaged; the base is not one of the averaged models. Given as task
vectors, θ_i = θ_base + τ_i, so the first form is θ_base + Σ_i w_i τ_i / Σ_i w_i and the second
(Σ_i w_i) θ_base + Σ_i w_i τ_i. λ does not apply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from tqdm.auto import tqdm

from mergecompose.merging.method_settings import LinearSettings, NamedBySettings


@dataclass(frozen=True)
class Linear(NamedBySettings):
    settings: type[LinearSettings] = LinearSettings
    reference: str = "https://arxiv.org/abs/2203.05482"
    mergekit: bool = True  # mergekit runs it under the same name

    def __call__(
        self,
        base: Mapping[str, torch.Tensor],
        task_vectors: Sequence[Mapping[str, torch.Tensor]],
        settings: LinearSettings,
        progress: bool = False,
    ) -> dict[str, torch.Tensor]:
        """θ for every floating-point tensor of `base` (a name missing from a task vector is θ_base there)."""
        total = sum(cast(list[float], settings.weights))  # filled in by validation with the number of inputs
        result = {}
        for name in tqdm(list(base), desc="linear merge", disable=not progress, leave=False):
            present = [task_vector[name] for task_vector in task_vectors if name in task_vector]
            if not present:
                dtype = torch.float64 if base[name].dtype == torch.float64 else torch.float32
                merged = base[name].to(dtype) if settings.normalize else total * base[name].to(dtype)
                result[name] = merged
                continue
            deltas = [task_vector.get(name, torch.zeros_like(present[0])) for task_vector in task_vectors]
            stacked = torch.stack(deltas)  # (k, *shape)
            weights = torch.tensor(settings.weights, dtype=stacked.dtype, device=stacked.device)
            weighted = (stacked * weights.reshape(-1, *([1] * (stacked.dim() - 1)))).sum(dim=0)  # (*shape)
            base_tensor = base[name].to(device=stacked.device, dtype=stacked.dtype)
            if settings.normalize:
                result[name] = base_tensor + weighted / total
            else:
                result[name] = total * base_tensor + weighted
        return result
