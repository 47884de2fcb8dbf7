"""Parameter-space overlap of task vectors, reported next to the output-space overlap O_ij.

For a pair of task vectors τ_i, τ_j (`mergecompose.merging.TaskVector`):

* `cosine`: cos(τ_i, τ_j) over all tensors (`TaskVector.cosine`);
* the TIES trim (Yadav et al., 2023): keep the top `density` share of |τ| over the whole
  flattened model (the paper's global scope, `mergecompose.merging.sparsify.magnitude_trim_global`), giving
  masks `M_i`, `M_j` of kept entries;
* `trimmed_mask_jaccard = |M_i ∩ M_j| / |M_i ∪ M_j|`: do the two updates keep the same entries;
* `ties_sign_conflict = |{e ∈ M_i ∩ M_j : sgn τ_i(e) ≠ sgn τ_j(e)}| / |M_i ∩ M_j|`: among the
  entries both keep (the only ones where TIES has to elect a sign between the two), the share
  with opposite signs; None when no entry is kept by both. Multiply by the Jaccard for the share
  of all kept entries.

A tensor that one task vector lacks (a LoRA adapter covers only its modules) counts as zero.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mergecompose.analysis.summaries import pair_key
from mergecompose.merging.sparsify import magnitude_trim_global


def trimmed_masks(task_vector, density: float) -> dict[str, torch.Tensor]:
    """The TIES keep-masks `{name: bool tensor}` of one task vector, global top-`density` by |τ|."""
    if not 0 < density <= 1:
        raise ValueError(f"`density` must be in (0, 1], got {density}")
    trimmed = magnitude_trim_global(task_vector.tensors, density)
    return {name: tensor != 0 for name, tensor in trimmed.items()}


def pair_parameter_overlap(tensors_i, tensors_j, masks_i, masks_j) -> dict:
    """Jaccard of the keep-masks and TIES sign-conflict share for one pair (see the module docstring)."""
    both = either = conflicting = 0
    for name in set(masks_i) | set(masks_j):
        if name in masks_i and name in masks_j:
            mask_i, mask_j = masks_i[name], masks_j[name]
            kept_by_both = mask_i & mask_j
            both += int(kept_by_both.sum())
            either += int((mask_i | mask_j).sum())
            opposite = torch.sign(tensors_i[name]) * torch.sign(tensors_j[name]) < 0
            conflicting += int((kept_by_both & opposite).sum())
        else:
            either += int((masks_i.get(name, masks_j.get(name))).sum())
    return {
        "trimmed_mask_jaccard": both / either if either else 0.0,
        "ties_sign_conflict": conflicting / both if both else None,
    }


def parameter_overlap(task_vectors: Mapping[str, object], density: float = 0.2) -> dict[str, dict]:
    """Cosine, TIES sign-conflict share and trimmed-mask Jaccard for every pair of task vectors.

    Args:
        task_vectors: `{expert name: mergecompose.merging.TaskVector}`, in the experts' order.
        density: the TIES trim's kept share, default 0.2 (the paper's top-20 %).

    Returns:
        `{"a|b": {"cosine", "ties_sign_conflict", "trimmed_mask_jaccard", "density"}}`.
    """
    names = list(task_vectors)
    masks = {name: trimmed_masks(task_vectors[name], density) for name in names}
    result = {}
    for index, name_i in enumerate(names):
        for name_j in names[index + 1 :]:
            tv_i, tv_j = task_vectors[name_i], task_vectors[name_j]
            measures = {"cosine": tv_i.cosine(tv_j)}
            measures.update(pair_parameter_overlap(tv_i.tensors, tv_j.tensors, masks[name_i], masks[name_j]))
            measures["density"] = density
            result[pair_key(name_i, name_j)] = measures
    return result
