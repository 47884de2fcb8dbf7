"""LoRA experts without full copies: dense ΔW of an adapter, adapters combined into one, training.

peft's `add_weighted_adapter` also offers `linear`, `ties`, `dare_*` and `magnitude_prune`
combinations. They merge the A matrices and the B matrices *separately*: `linear` builds
A = Σ_i c_i A_i and B = Σ_i c_i B_i with c_i = √(w_i s_i), so B A = Σ_i Σ_j c_i c_j B_i A_j holds the
cross terms B_i A_j (i ≠ j) and is not Σ_i w_i ΔW_i; on random adapters it is far from it (see
`tests/merging/test_merging_lora.py`). Do not use them as ΔW merges. Only `cat` (stack the ranks: exact)
and `svd` (truncate Σ_i w_i ΔW_i to a rank: approximate) combine the true ΔW; they are the two
offered here, with the relative error of ΔW reported. To merge ΔW with TIES or DARE, build dense
task vectors (`TaskVector.from_lora`) and use `mergecompose.merging.merge`.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
from peft import LoraConfig, PeftConfig, PeftModel
from peft.tuners.lora import LoraLayer
from peft.utils import PeftType
from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

from mergecompose.core.adapters import check_adapter_fits, read_adapter, warn_if_made_for_another_base
from mergecompose.core.boundary import check_adapter
from mergecompose.core.io import atomic_output_dir, refuse_existing, refuse_output_over_inputs
from mergecompose.merging.state_dicts import check_finite_tensors, check_same_shape, compute_dtype, state_dict_of


def _check_lora_config(config: PeftConfig, where: str) -> None:
    if config.peft_type != PeftType.LORA:
        raise ValueError(
            f"{where} is a {config.peft_type} adapter; only LoRA adapters have a dense ΔW = s · B @ A here"
        )
    if getattr(config, "use_dora", False):
        raise ValueError(
            f"{where} is a DoRA adapter, which is not supported: its merged weight m · (W + ΔW) / ‖W + ΔW‖ "
            "is not W + ΔW. Merge it with `merge_and_unload()` and use `TaskVector.from_models` instead"
        )


def lora_delta_weights(
    base_model: torch.nn.Module, adapter: str | os.PathLike | PeftModel, *, allow_nonfinite: bool = False
) -> dict[str, torch.Tensor]:
    """{base tensor name: ΔW} of a peft LoRA adapter, in float32 (float64 for a float64 base).

    ΔW = scaling · B @ A for each adapted module, computed by peft's `LoraLayer.get_delta_weight`,
    so scaling is peft's (lora_alpha / r, lora_alpha / √r with rsLoRA, per-module rank / alpha
    patterns) and fan-in-fan-out and embedding layouts are handled. With `lora_bias`, the bias
    gets scaling · b_B. `modules_to_save` copies contribute (copy − original). DoRA and other
    LoRA variants raise a ValueError, as do other wrappers (trainable tokens).

    `adapter` is a folder or hub id (loaded onto a deep copy of `base_model`, which is never
    modified) or a PeftModel (its active adapter is read as is). An adapter made for another base
    is refused naming the module and both shapes; NaN or inf adapter weights unless `allow_nonfinite`.
    One whose recorded base clearly names another model than `base_model` gets a UserWarning
    (`mergecompose.core.adapters.warn_if_made_for_another_base`).
    """
    base_state = state_dict_of(base_model, "base_model")
    warn_if_made_for_another_base(adapter, base_model)  # its recorded base, before any weights load
    if isinstance(adapter, PeftModel):
        peft_model, name = adapter, adapter.active_adapter
        _check_lora_config(peft_model.peft_config[name], f"adapter `{name}`")
        if not allow_nonfinite:
            check_finite_tensors(read_adapter(adapter)[1], f"adapter `{name}`")
    elif isinstance(adapter, (str, os.PathLike)):
        config, adapter_state = read_adapter(check_adapter(adapter, "adapter"))
        _check_lora_config(config, f"adapter {str(adapter)!r}")
        check_adapter_fits(str(adapter), config, adapter_state, base_model)  # names the module and both shapes
        if not allow_nonfinite:
            check_finite_tensors(adapter_state, f"adapter {str(adapter)!r}")
        name = "default"
        peft_model = PeftModel.from_pretrained(copy.deepcopy(base_model), str(adapter), adapter_name=name)
    else:
        raise ValueError(f"`adapter` must be a peft adapter folder or a PeftModel, got {type(adapter).__name__}")

    deltas: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for module_path, module in peft_model.get_base_model().named_modules():
            if isinstance(module, LoraLayer) and (name in module.lora_A or name in module.lora_embedding_A):
                if name in getattr(module, "lora_variant", {}):
                    variant = type(module.lora_variant[name]).__name__
                    raise ValueError(
                        f"module `{module_path}` uses the LoRA variant {variant}, whose update is not B @ A"
                    )
                # peft's LoraLayer does not declare `get_delta_weight`; each of its layer classes defines it.
                delta = module.get_delta_weight(name)  # type: ignore[attr-defined]
                _add_delta(deltas, base_state, f"{module_path}.weight", delta)
                if module.lora_bias.get(name, False):
                    _add_delta(
                        deltas, base_state, f"{module_path}.bias", module.lora_B[name].bias * module.scaling[name]
                    )
            elif isinstance(module, ModulesToSaveWrapper) and name in module.modules_to_save:
                original = dict(module.original_module.named_parameters())
                for parameter_name, parameter in module.modules_to_save[name].named_parameters():
                    _add_delta(
                        deltas, base_state, f"{module_path}.{parameter_name}", parameter - original[parameter_name]
                    )
            elif isinstance(module, AuxiliaryTrainingWrapper) and not isinstance(module, ModulesToSaveWrapper):
                raise ValueError(
                    f"module `{module_path}` is wrapped by {type(module).__name__}, which is not supported"
                )
    if not deltas:
        raise ValueError(f"adapter `{name}` adapts no module of the base model")
    return deltas


def _add_delta(
    deltas: dict[str, torch.Tensor], base_state: Mapping[str, torch.Tensor], key: str, delta: torch.Tensor
) -> None:
    if key not in base_state:
        raise ValueError(
            f"the adapter changes `{key}`, which the base model does not have; was it made for another base?"
        )
    check_same_shape(key, base_state[key].shape, delta.shape, what=("base", "adapter ΔW"))
    dtype = compute_dtype(base_state[key].dtype, delta.dtype)
    deltas[key] = delta.detach().to(dtype).clone()


# ---- combining adapters ------------------------------------------------------------------------


@dataclass
class LoraCombination:
    """What `combine_lora_adapters` wrote and how far its ΔW is from Σ_i w_i ΔW_i."""

    adapter_dir: Path
    method: str
    rank: int
    weights: list[float]
    relative_error: float  # ‖ΔW − Σ w ΔW_i‖_F / ‖Σ w ΔW_i‖_F over all modules together
    module_errors: dict[str, float] = field(default_factory=dict)  # the same, per module


def combine_lora_adapters(
    base_model: torch.nn.Module,
    adapters: Mapping[str, str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    weights: Sequence[float] | None = None,
    method: str = "cat",
    rank: int | None = None,
    overwrite: bool = False,
    allow_nonfinite: bool = False,
) -> LoraCombination:
    """Combine LoRA adapters of one base into one adapter whose ΔW ≈ Σ_i w_i ΔW_i.

    method="cat": exact. A and B of every adapter are stacked (peft's `cat`), rank Σ_i r_i.
    method="svd": approximate with the stated `rank`: the best rank-`rank` approximation of
        Σ_i w_i ΔW_i per module (peft's `svd`, truncated SVD).

    The relative error ‖ΔW − Σ w_i ΔW_i‖_F / ‖Σ w_i ΔW_i‖_F, per module and over all modules,
    is measured on the result and written to `combination.json` beside the adapter.

    peft before 0.22 copies `use_rslora` into `add_weighted_adapter`'s combined config, so with
    rsLoRA the combined adapter's scaling becomes √(new rank) instead of 1 (peft issue #3761, PR
    #3449); this function resets it to 1. Adapters with DoRA or `lora_bias` are refused (peft's
    combination ignores both), as are adapters made for another base and, unless `allow_nonfinite`,
    adapters with NaN or inf weights.
    """
    if method not in ("cat", "svd"):
        raise ValueError(
            f"`method` must be 'cat' (exact) or 'svd' (approximate), got {method!r}; peft's linear/ties/dare "
            "adapter combinations merge A and B separately and do not give Σ w_i ΔW_i"
        )
    if method == "svd" and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise ValueError(f"`rank` must be a positive integer for method='svd', got {rank!r}")
    if method == "cat" and rank is not None:
        raise ValueError(f"`rank` does not apply to method='cat' (its rank is the sum of the ranks), got {rank}")
    if not adapters:
        raise ValueError("`adapters` must name at least one adapter folder, got none")
    names = list(adapters)
    for name in names:  # every adapter's files, before the first one loads
        check_adapter(adapters[name], f"adapters[{name!r}]")
    weights = [1.0] * len(names) if weights is None else [float(weight) for weight in weights]
    if len(weights) != len(names) or not all(math.isfinite(weight) for weight in weights):
        raise ValueError(f"`weights` must hold {len(names)} finite numbers, got {weights}")
    refuse_output_over_inputs(out_dir, adapters.values())
    refuse_existing(out_dir, overwrite)

    for index, name in enumerate(names):
        config, adapter_state = read_adapter(adapters[name], f"adapters[{name!r}]")
        _check_lora_config(config, f"adapter `{name}`")
        check_adapter_fits(name, config, adapter_state, base_model)
        if not allow_nonfinite:
            check_finite_tensors(adapter_state, f"adapter `{name}` ({str(adapters[name])!r})")
        if getattr(config, "lora_bias", False):
            raise ValueError(f"adapter `{name}` has lora_bias=True, which peft's adapter combination ignores")
        if index == 0:
            peft_model = PeftModel.from_pretrained(copy.deepcopy(base_model), str(adapters[name]), adapter_name=name)
        else:
            peft_model.load_adapter(str(adapters[name]), adapter_name=name)
    combined = "combined"
    peft_model.add_weighted_adapter(names, weights, combined, combination_type=method, svd_rank=rank)
    combined_config = cast(LoraConfig, peft_model.peft_config[combined])  # a combination of LoRA adapters
    combined_config.use_rslora = False  # lora_alpha = r: scaling 1 on reload

    squared_error, squared_target, module_errors = 0.0, 0.0, {}
    with torch.no_grad():
        for module_path, module in peft_model.get_base_model().named_modules():
            if not (isinstance(module, LoraLayer) and combined in module.scaling):
                continue
            module.scaling[combined] = 1.0  # the sources' scalings are already folded into A and B
            delta_weight = module.get_delta_weight  # type: ignore[attr-defined]  # see lora_delta_weights
            target = sum(
                weight * delta_weight(name).double()
                for name, weight in zip(names, weights)
                if name in module.lora_A or name in module.lora_embedding_A
            )
            error = (delta_weight(combined).double() - target).norm().item()
            target_norm = float(torch.as_tensor(target).norm())
            module_errors[module_path] = error / target_norm if target_norm > 0 else error
            squared_error += error**2
            squared_target += target_norm**2
    relative_error = (
        math.sqrt(squared_error) / math.sqrt(squared_target) if squared_target > 0 else math.sqrt(squared_error)
    )
    new_rank = int(combined_config.r)

    with atomic_output_dir(out_dir, overwrite) as folder:
        peft_model.save_pretrained(str(folder / "save"), selected_adapters=[combined])
        for path in (folder / "save" / combined).iterdir():  # peft saves a named adapter in a subfolder
            path.rename(folder / path.name)
        shutil.rmtree(folder / "save")
        record = {
            "method": method,
            "rank": new_rank,
            "adapters": {name: str(adapters[name]) for name in names},
            "weights": weights,
            "relative_error": relative_error,
            "module_errors": module_errors,
        }
        (folder / "combination.json").write_text(json.dumps(record, indent=2))
    return LoraCombination(Path(out_dir), method, new_rank, weights, relative_error, module_errors)
