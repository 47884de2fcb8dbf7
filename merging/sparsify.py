"""Sparsification of task vectors: magnitude trimming (TIES), random drop (DARE), outlier removal.

Pure functions; inputs are never modified. Where mergekit's primitive computes exactly what a
definition asks for, it is called.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from mergekit.sparsify import RescaleNorm, magnitude, magnitude_outliers, rescaled_masked_tensor


def magnitude_trim_global(task_vector: Mapping[str, torch.Tensor], density: float) -> dict[str, torch.Tensor]:
    """Keep the k = max(1, ⌊density · n⌋) largest |τ| of a whole task vector, zero the rest.

    n is the number of entries of the task vector, all tensors flattened together, as in the TIES
    paper (Yadav et al., 2023, arXiv:2306.01708, "trim": keep the top-k% values) and its reference
    code, which flattens the model into one vector. Entries tied with the k-th largest magnitude
    are all kept. (The reference code compares with the (n − ⌊density·n⌋)-th smallest value, which
    keeps one entry more than ⌊density·n⌋.) density=1 returns the tensors unchanged.
    """
    if density >= 1.0 or not task_vector:
        return dict(task_vector)
    magnitudes = torch.cat([tensor.detach().abs().reshape(-1).float().cpu() for tensor in task_vector.values()])  # (n,)
    count = magnitudes.numel()
    keep = max(1, int(density * count))
    threshold = torch.kthvalue(magnitudes, count - keep + 1).values  # the keep-th largest |τ|
    del magnitudes
    return {
        name: tensor * (tensor.abs().float() >= threshold.to(tensor.device)).to(tensor.dtype)
        for name, tensor in task_vector.items()
    }


def magnitude_trim(tensor: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the k = max(1, ⌊density · numel⌋) largest |τ| of one tensor (TIES trim, per tensor).

    This is mergekit's and peft's scope; mergekit's `sparsify.magnitude` is called. (peft's
    `magnitude_based_pruning` keeps ⌊density · numel⌋, without the minimum of 1.)
    """
    return magnitude(tensor, density=density)


def random_drop(tensor: torch.Tensor, drop_rate: float, rescale: str, generator: torch.Generator) -> torch.Tensor:
    """DARE (Yu et al., 2023, arXiv:2311.03099): drop each entry with probability p, rescale the rest.

    mask ~ Bernoulli(1 − p) per entry, drawn from `generator` (the same draws as
    `torch.bernoulli(torch.full_like(τ, 1 − p))` after `torch.manual_seed`, which is what peft and
    mergekit do).

    rescale="inverse": τ̂ = m ⊙ τ / (1 − p), the DARE paper's rescaling, as in peft.
    rescale="l1": τ̂ = m ⊙ τ · ‖τ‖₁ / ‖m ⊙ τ‖₁ over the tensor, as mergekit does (its
        `rescaled_masked_tensor` is called).

    drop_rate=0 returns the tensor unchanged and draws nothing.
    """
    if drop_rate <= 0.0:
        return tensor
    keep = 1.0 - drop_rate
    probabilities = torch.full(tensor.shape, keep, dtype=torch.float32, device=generator.device)
    mask = torch.bernoulli(probabilities, generator=generator).to(device=tensor.device, dtype=tensor.dtype)
    if rescale == "inverse":
        return tensor * mask / keep
    return rescaled_masked_tensor(tensor, mask, RescaleNorm.l1)


def outlier_trim(tensor: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    """Model Breadcrumbs (Davari & Belilovsky, 2023, arXiv:2312.06795), per tensor.

    Drop the ⌊gamma · numel⌋ largest |τ| (outliers), keep the next ⌊density · numel⌋ entries by
    magnitude, zero the smallest. Where gamma + density > 1, fewer outliers are dropped so that
    ⌊density · numel⌋ entries are kept; density=1 keeps everything. mergekit's
    `sparsify.magnitude_outliers` is called.
    """
    return magnitude_outliers(tensor, density=density, gamma=gamma)
