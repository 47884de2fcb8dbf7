"""Drafts for speculative decoding: the task-arithmetic merge of a composition's own experts, built in memory.

    θ = θ_b + Σ_i λ_i (θ_i − θ_b)        (task arithmetic, Ilharco et al. 2023)

The natural draft for a composition: one forward pass instead of k+1, and close to the composition
where its experts' task vectors barely interact (docs/guides/speculative-decoding.md).
Full experts are merged by `mergecompose.merging.merge`; LoRA experts add peft's λ_i ΔW_i to a copy
of the base. Tensors the merge leaves unchanged are shared with the base, never copied. A draft whose
merged weights come out NaN or inf (a huge `draft_lambda` overflows the dtype) is refused, as a merge is.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import cast

import torch
from peft.tuners.lora.layer import LoraLayer
from transformers import PreTrainedModel

from mergecompose.core.adapters import load_adapters_on_base
from mergecompose.merging import merge
from mergecompose.merging.state_dicts import check_finite


def merged_full_draft(
    base_model: PreTrainedModel, expert_models: Sequence[torch.nn.Module], lambdas: Sequence[float]
) -> PreTrainedModel:
    """The task-arithmetic merge of full experts as a model: θ_b + Σ_i λ_i (θ_i − θ_b).

    Each floating tensor is `merge("task_arithmetic", ..., weights=λ, lam=1)`'s, computed one tensor at a
    time so that only one tensor's float32 copies are alive at once. Integer buffers are the base's own;
    tensors tied in the base (one storage under two names) are merged once and stay shared. Raises a
    ValueError naming the expert and the tensor if the experts' names or shapes differ from the base's,
    and one naming `draft_lambda` and the tensor if a merged tensor is not finite.
    """
    base_state = base_model.state_dict()
    expert_states = [expert.state_dict() for expert in expert_models]
    _check_like_base(base_state, expert_states)
    weights = [float(scale) for scale in lambdas]
    merged: dict[str, torch.Tensor] = {}
    done: dict[tuple, torch.Tensor] = {}  # (storage pointer, shape, dtype) of a base tensor -> its merged tensor
    for name, base in base_state.items():
        if not base.is_floating_point():
            merged[name] = base
            continue
        key = (base.data_ptr(), tuple(base.shape), base.dtype)
        if key not in done:
            experts = [{name: state[name].to(base.device)} for state in expert_states]
            # The merged tensor is checked here, with an error that names `draft_lambda`, not merge's `weights`.
            done[key] = merge(
                "task_arithmetic", {name: base}, experts, weights=weights, lam=1.0, progress=False, allow_nonfinite=True
            )[name]
            _check_finite_draft(name, done[key], weights)
        merged[name] = done[key]
    return model_with_weights(base_model, merged)


def merged_lora_draft(
    base_model: PreTrainedModel, adapters: Mapping[str, object], lambdas: Sequence[float]
) -> PreTrainedModel:
    """The task-arithmetic merge of LoRA experts as a model: W + Σ_i λ_i ΔW_i in every adapted layer.

    ΔW_i is peft's `LoraLayer.get_delta_weight` (its scaling, rsLoRA and fan-in-fan-out layouts).
    `base_model` may carry the composition's LoRA layers (peft) or its stacked forwards: only its
    plain weights are read (`*.base_layer.*` renamed, `lora_*` dropped). Tensors the adapters do not
    change are shared with it; adapted weights are new tensors. Raises a ValueError naming `draft_lambda`
    and the tensor if an adapted weight is not finite.
    """
    plain = dict(_plain_named(base_model.state_dict().items()))
    draft = model_with_weights(base_model, plain)
    peft_model, names = load_adapters_on_base(draft, adapters)
    scales = dict(zip(names, lambdas))
    with torch.no_grad():
        for path, module in peft_model.get_base_model().named_modules():
            if not isinstance(module, LoraLayer):
                continue
            present = [name for name in names if name in module.lora_A]
            if any(name in getattr(module, "lora_variant", {}) for name in present):
                raise ValueError(f"draft='merged' cannot merge module `{path}`: it uses a LoRA variant (e.g. DoRA)")
            layer = module.get_base_layer()
            weight = cast(torch.Tensor, layer.weight)
            for name in present:
                # peft defines get_delta_weight on each LoRA layer class (Linear, Embedding, ...), not on LoraLayer.
                delta = module.get_delta_weight(name)  # type: ignore[attr-defined]
                weight = weight + scales[name] * delta.to(weight.dtype)
            _check_finite_draft(f"{path}.weight", weight, lambdas)
            layer.weight = torch.nn.Parameter(weight, requires_grad=False)  # a new tensor: the base's stays as it was
    return peft_model.unload().eval()


def model_with_weights(model: PreTrainedModel, state_dict: Mapping[str, torch.Tensor]) -> PreTrainedModel:
    """A new model of `model`'s class and config holding `state_dict`'s tensors themselves (no copy).

    Built on the meta device, so no memory is allocated for weights that are then replaced; the
    buffers that are not saved (rotary frequencies) are `model`'s own. `model` is never modified:
    what the new model shares with it, it only reads."""
    with torch.device("meta"):
        copy = type(model)(model.config)
    copy.load_state_dict(dict(state_dict), strict=True, assign=True)
    saved = set(state_dict)
    for name, buffer in _plain_named(model.named_buffers()):
        if name not in saved:  # a buffer that is not saved, e.g. RoPE's inverse frequencies
            module_path, _, attribute = name.rpartition(".")
            copy.get_submodule(module_path)._buffers[attribute] = buffer
    copy.generation_config = model.generation_config
    return copy.eval().requires_grad_(False)


def _check_like_base(
    base_state: Mapping[str, torch.Tensor], expert_states: Sequence[Mapping[str, torch.Tensor]]
) -> None:
    """The experts must hold the base's tensor names and shapes; the error names the expert and the tensor."""
    names = set(base_state)
    for index, state in enumerate(expert_states):
        if set(state) != names:
            different = sorted(names ^ set(state))[:3]
            raise ValueError(
                f"draft='merged' needs experts with the base's parameter names; `expert_models[{index}]` differs "
                f"in {different}"
            )
    for name, base in base_state.items():
        if not base.is_floating_point():
            continue
        for index, state in enumerate(expert_states):
            if state[name].shape != base.shape:
                raise ValueError(
                    f"draft='merged' needs experts of the base's shapes; `expert_models[{index}]`'s `{name}` has "
                    f"shape {tuple(state[name].shape)}, the base's {tuple(base.shape)}"
                )


def _check_finite_draft(name: str, tensor: torch.Tensor, lambdas: Sequence[float]) -> None:
    """Refuse a merged draft tensor holding NaN or inf, naming `draft_lambda` (the λ_i of the merge)."""
    check_finite(
        name,
        tensor,
        "the merged draft (draft='merged')",
        hint=f"with `draft_lambda` {[float(x) for x in lambdas]!r} (λ_i, by default the composition's weights), "
        "θ_b + Σ_i λ_i (θ_i − θ_b) overflows its dtype: give a smaller `draft_lambda` (or experts without NaN or inf)",
    )


def _plain_named(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a model that may carry peft LoRA layers, as the plain model names them."""
    for name, tensor in items:
        if "lora_" not in name:
            yield name.replace(".base_layer.", "."), tensor
