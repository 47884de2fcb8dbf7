"""For LoRA experts: how much each expert's update responds to the inputs another expert produces.

Input-space interference (OSRM: Zhang & Zhou, ACL 2025, "Unraveling LoRA interference: orthogonal subspaces for
robust model merging"). Per adapted linear layer l and ordered pair (i, j), with `H_i` the layer's inputs in expert
i's model (base + adapter i) over the measured positions and `ΔW_j = s_j B_j A_j` expert j's update (peft's
`lora_B ∘ lora_A` times its `scaling`):

    ρ_l(i, j) = ‖ΔW_j H_i‖_F / ‖ΔW_i H_i‖_F

how strongly expert j's update answers the inputs expert i's own computation produces, relative to expert i's own
update. A merge adds every ΔW_j to the base, so where ρ is large expert j's update disturbs expert i's computation;
near 0, the updates act on separate input subspaces. `ρ_l(i, j) = 0` where adapter j does not adapt layer l; NaN
where adapter i does not (or gives 0 there): no own update to compare with.

Summaries: per ordered pair the mean and the largest ρ over layers (NaN layers left out); over pairs, both
directions, `mean` (of the pairs' means) and `max`. Undefined for full checkpoints (no factors, no `ΔW_j H_i`
without a dense product per layer): a rule that reads it applies to LoRA experts only.

`interference_ratios` and `interference_summary` are pure; `input_interference` runs the experts' models.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
from peft.tuners.lora import LoraLayer

from mergecompose.core.adapters import load_adapters_on_base


def interference_ratios(square_sums: torch.Tensor) -> torch.Tensor:
    """`ρ_l(i, j) = sqrt(S_l[i, j] / S_l[i, i])` from `S_l[i, j] = ‖ΔW_j H_i‖_F²`.

    Args:
        square_sums: `(L, k, k)`, layer by (inputs of expert i, update of expert j).

    Returns:
        `(L, k, k)` float64; NaN where `S_l[i, i] = 0`.
    """
    if square_sums.dim() != 3 or square_sums.shape[1] != square_sums.shape[2]:
        raise ValueError(f"`square_sums` must be (L, k, k), got {tuple(square_sums.shape)}")
    sums = square_sums.double()
    own = torch.diagonal(sums, dim1=1, dim2=2)[:, :, None]  # (L, k, 1): S_l[i, i]
    return torch.where(own > 0, (sums / own.clamp(min=torch.finfo(torch.float64).tiny)).sqrt(), math.nan)


def interference_summary(ratios: torch.Tensor, names: Sequence[str]) -> dict:
    """`{"pairs": {"i→j": {"mean", "max"}}, "mean", "max"}` over layers (NaN layers left out; None where a pair has
    no layer with a value)."""
    k = len(names)
    pairs, means, maxima = {}, [], []
    for i in range(k):
        for j in range(k):
            if i == j:
                continue
            values = ratios[:, i, j]
            values = values[~values.isnan()]
            mean = float(values.mean()) if len(values) else None
            largest = float(values.max()) if len(values) else None
            pairs[f"{names[i]}→{names[j]}"] = {"mean": mean, "max": largest}
            if mean is not None:
                means.append(mean)
                maxima.append(largest)
    return {
        "pairs": pairs,
        "mean": sum(means) / len(means) if means else None,
        "max": max(maxima) if maxima else None,
    }


@torch.no_grad()
def input_interference(
    base_model: torch.nn.Module, adapters: Mapping[str, object], batches: Iterable[Mapping[str, torch.Tensor]]
) -> dict:
    """ρ_l(i, j) for LoRA adapters on `base_model`, over the positions of `batches` (`input_ids`, and
    `attention_mask` where some positions are padding): one forward pass of each expert's model per batch.

    The adapters are injected into `base_model` (`load_adapters_on_base`) and taken out again after (`unload`),
    so `base_model` is left as it was. Returns `interference_summary` plus `layers`, the adapted layers' names, and
    `ratios` per layer (`{layer: {"i→j": ρ}}`, None for NaN).
    """
    names = list(adapters)
    if len(names) < 2:
        raise ValueError(f"input interference needs two or more adapters, got {len(names)}")
    batches = list(batches)
    peft_model, names = load_adapters_on_base(base_model, adapters)
    try:
        layers = _adapted_layers(peft_model, names)
        sums = torch.zeros(len(layers), len(names), len(names), dtype=torch.float64)
        state: dict = {}

        def hook(index: int):
            def capture(module: torch.nn.Module, args: tuple) -> None:
                inputs = args[0]
                mask = state["mask"]
                rows = inputs[mask] if mask is not None else inputs.reshape(-1, inputs.shape[-1])
                for j, name in enumerate(names):
                    if name in module.lora_A:
                        update = module.lora_B[name](module.lora_A[name](rows)) * module.scaling[name]
                        sums[index, state["expert"], j] += update.double().square().sum()

            return capture

        handles = [module.register_forward_pre_hook(hook(index)) for index, (_, module) in enumerate(layers)]
        try:
            for expert, name in enumerate(names):
                peft_model.set_adapter(name)
                state["expert"] = expert
                for batch in batches:
                    mask = batch.get("attention_mask")
                    state["mask"] = None if mask is None else mask.bool()
                    peft_model(input_ids=batch["input_ids"], attention_mask=mask)
        finally:
            for handle in handles:
                handle.remove()
    finally:
        peft_model.unload()
    ratios = interference_ratios(sums)
    summary = interference_summary(ratios, names)
    summary["layers"] = [name for name, _ in layers]
    summary["ratios"] = {
        layer: {
            f"{names[i]}→{names[j]}": (None if math.isnan(float(ratios[index, i, j])) else float(ratios[index, i, j]))
            for i in range(len(names))
            for j in range(len(names))
            if i != j
        }
        for index, (layer, _) in enumerate(layers)
    }
    return summary


def _adapted_layers(peft_model: torch.nn.Module, names: list[str]) -> list[tuple[str, LoraLayer]]:
    """Every LoRA linear layer that adapts some of `names`, by module name; DoRA (whose update is not `s B A`) and
    LoRA on embeddings are refused."""
    layers = []
    for module_name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        used = [name for name in names if name in module.lora_A or name in module.lora_embedding_A]
        if not used:
            continue
        if any(name in module.lora_embedding_A for name in used) or not isinstance(
            module.get_base_layer(), torch.nn.Linear
        ):
            raise ValueError(
                f"input interference reads LoRA on linear layers only; layer {module_name!r} is "
                f"{type(module.get_base_layer()).__name__}"
            )
        if any(module.use_dora.get(name, False) for name in used):
            raise ValueError(f"input interference does not read DoRA adapters (layer {module_name!r})")
        layers.append((module_name.removeprefix("base_model.model."), module))
    if not layers:
        raise ValueError(f"no LoRA layer adapts any of {names}")
    return layers
