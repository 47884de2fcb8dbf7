"""`merge`: the in-memory entry point. Models, state dicts or task vectors in; a full state dict out."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
import yaml
from safetensors.torch import save_file

from mergecompose.core.io import atomic_output_dir, refuse_existing
from mergecompose.merging.methods import get_method, validate_merge_params
from mergecompose.merging.state_dicts import (
    check_finite,
    check_finite_tensors,
    check_same_shape,
    is_mergeable,
    share_updates_of_tied,
    state_dict_of,
)
from mergecompose.merging.task_vector import TaskVector
from mergecompose.merging.user_methods import import_path_of

# Pass as `merge(..., **MERGEKIT_MODE)` to follow mergekit's definitions (what `merge_checkpoints`
# computes on disk), or `**PEFT_MODE` for peft's `merge_utils`. The defaults follow the papers.
MERGEKIT_MODE = MappingProxyType({"consensus": "mergekit", "trim_scope": "per_tensor", "rescale": "l1"})
PEFT_MODE = MappingProxyType({"consensus": "paper", "trim_scope": "per_tensor", "rescale": "inverse"})


def merge(
    method: str | Callable[..., Any],
    base: torch.nn.Module | Mapping[str, torch.Tensor],
    finetuned_or_task_vectors: Sequence[torch.nn.Module | Mapping[str, torch.Tensor] | TaskVector],
    *,
    out_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
    progress: bool = True,
    allow_nonfinite: bool = False,
    **params: Any,
) -> dict[str, torch.Tensor]:
    """Merge k fine-tuned models (or task vectors) into `base`: θ = θ_base + λ · merge_i(w_i, τ_i).

    Args:
        method: a name in `mergecompose.merging.METHODS`, a user's method as its import path
            `package.module:Name`, or the user's function or class itself (named by its import path).
        base: the base model (torch module) or its state dict.
        finetuned_or_task_vectors: a list of k models, state dicts or `TaskVector`s (mixed is
            fine); models and state dicts become τ_i = θ_i − θ_base.
        params: the method's parameters, validated by its model `METHODS[method].settings`
            (`mergecompose.merging.method_settings`; None means the method's default):
            weights: w_i per input, default 1.0 each.
            lam: λ, scaling of the merged task vector (not for linear; > 0 for ties / dare_ties).
            density: fraction of entries kept, in (0, 1]: ties, magnitude_prune, breadcrumbs (and
                DARE as 1 − drop_rate).
            drop_rate: DARE's p in [0, 1).
            gamma: breadcrumbs' fraction of largest entries removed (default 0.01).
            seed: DARE's random seed (default 0); the merge is deterministic given it.
            consensus: "paper" (default) or "mergekit": where the weights enter the sign election
                and what the disjoint mean divides by (see `mergecompose.merging.generalized_task_arithmetic`).
            sign_election: "mass" (default, sgn Σ τ) or "count" (sgn Σ sgn τ).
            trim_scope: "global" (TIES paper; ties' default) or "per_tensor" (mergekit, peft).
            rescale: DARE's "inverse" (1/(1 − p); default) or "l1" (mergekit; default under
                consensus="mergekit").
            normalize: divide the merged delta by Σ w (or, with signs, by the count / the weights
                of the agreeing entries); the default is the method's (see `mergecompose.merging.methods`).
        out_dir: also write the merged model there (atomically): `save_pretrained` for a
            transformers model, `model.safetensors` for a state dict, and `merge_settings.yaml`
            with the resolved settings.
        overwrite: replace an existing `out_dir`.
        progress: show a tqdm bar over tensors.
        allow_nonfinite: merge NaN or inf weights (of the base or an input) and return a
            non-finite result; by default both are refused, naming the tensor.

    Returns:
        The merged full state dict, same names, shapes and dtypes as `base`'s, loadable with
        `model.load_state_dict`. Integer and bool buffers are copied from `base`. Tensors are
        computed in float32 (float64 if the inputs are) and cast back. Names tied in `base`
        (lm_head and embed_tokens) get the same merged tensor, even if the task vectors hold
        only one of them (as a tied checkpoint on disk does).

    Convention keywords (consensus, sign_election, trim_scope, rescale, seed) are checked for
    every method and ignored where they do not apply, so `**MERGEKIT_MODE` fits every method;
    any other parameter the method does not take raises. Inputs are never modified.

    Raises:
        ValueError: an unknown method (the valid ones are listed), a parameter the method does not
            take (its parameters are listed), a parameter out of range (named, with the value and
            the range), tensors whose names, shapes or kinds (float / integer) do not match, or
            (unless `allow_nonfinite`) NaN or inf in an input or in the merged result.
        FileExistsError: `out_dir` exists and `overwrite` is False.
    """
    method = import_path_of(method)
    merge_method = get_method(method)
    if isinstance(finetuned_or_task_vectors, (TaskVector, Mapping, torch.nn.Module)) or not isinstance(
        finetuned_or_task_vectors, Sequence
    ):
        raise ValueError(
            "`finetuned_or_task_vectors` must be a list of models, state dicts or TaskVectors, "
            f"got {type(finetuned_or_task_vectors).__name__}"
        )
    if len(finetuned_or_task_vectors) == 0:
        raise ValueError("`finetuned_or_task_vectors` must hold at least one model or task vector, got an empty list")
    settings = validate_merge_params(method, params, count=len(finetuned_or_task_vectors))
    if out_dir is not None:
        refuse_existing(out_dir, overwrite)
    base_state = state_dict_of(base, "base")
    float_base = {name: tensor for name, tensor in base_state.items() if is_mergeable(tensor)}
    if not allow_nonfinite:
        check_finite_tensors(float_base, "`base`")
    task_vectors = [
        _as_task_vector(item, base_state, index, allow_nonfinite)
        for index, item in enumerate(finetuned_or_task_vectors)
    ]
    merged = merge_method(float_base, [task_vector.tensors for task_vector in task_vectors], settings, progress)
    if not allow_nonfinite:
        overflow = (
            f"the inputs are finite, so λ · Σ w τ overflowed (lam={getattr(settings, 'lam', None)}, "
            f"weights={settings.weights}); nothing was returned or written (allow_nonfinite=True returns it)"
        )
        for name, tensor in merged.items():
            check_finite(name, tensor, "the merged model", hint=overflow)
    share_updates_of_tied(base_state, merged)
    result = {
        name: merged[name].to(device=tensor.device, dtype=tensor.dtype) if name in merged else tensor.clone()
        for name, tensor in base_state.items()
    }
    if out_dir is not None:
        with atomic_output_dir(out_dir, overwrite) as folder:
            save_pretrained = getattr(base, "save_pretrained", None)  # a transformers (or peft) model
            if save_pretrained is not None:
                save_pretrained(folder, state_dict=dict(result))  # transformers may pop keys
            else:
                save_file(
                    {name: tensor.contiguous() for name, tensor in result.items()}, str(folder / "model.safetensors")
                )
            record = {
                "settings": settings.model_dump(),
                "inputs": [type(item).__name__ for item in finetuned_or_task_vectors],
            }
            (folder / "merge_settings.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    return result


def _as_task_vector(
    item: object, base_state: Mapping[str, torch.Tensor], index: int, allow_nonfinite: bool
) -> TaskVector:
    """A TaskVector checked against `base_state`, or τ = item − base for a model / state dict."""
    where = f"finetuned_or_task_vectors[{index}]"
    if isinstance(item, TaskVector):
        for name, tensor in item.tensors.items():
            if name not in base_state:
                raise ValueError(f"{where} has tensor `{name}`, which `base` does not have")
            if not is_mergeable(base_state[name]):
                raise ValueError(f"{where} has tensor `{name}`, which is a {base_state[name].dtype} buffer in `base`")
            check_same_shape(name, base_state[name].shape, tensor.shape, what=("base", where))
            if not allow_nonfinite:
                check_finite(name, tensor, where)
        return item
    if isinstance(item, (torch.nn.Module, Mapping)):
        try:
            return TaskVector.from_state_dicts(base_state, state_dict_of(item, where), allow_nonfinite=allow_nonfinite)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from error
    raise ValueError(f"{where} must be a model, a state dict or a TaskVector, got {type(item).__name__}")
