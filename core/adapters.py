"""Load several peft LoRA adapters onto one base model, after checking that each fits it."""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping, Sequence
from typing import cast

import torch
from peft import PeftConfig, PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
from peft.utils import PeftType, load_peft_weights

from mergecompose.core.boundary import check_adapter

_NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")
# "base_model.model.<module path>.lora_A.weight" (adapter_name stripped on save).
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")


def read_adapter(source: object, argument: str = "adapter") -> tuple[PeftConfig, dict[str, torch.Tensor]]:
    """Return (config, state dict) of an adapter given as a folder, a hub id or a PeftModel.

    A folder or hub id is checked first (`mergecompose.core.boundary.check_adapter`): a missing
    folder, a full checkpoint or a hub id offline mode cannot load is named with `argument`.
    """
    if isinstance(source, PeftModel):
        name = source.active_adapter
        return source.peft_config[name], get_peft_model_state_dict(source, adapter_name=name)
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"`{argument}` must be a folder, a hub id or a PeftModel, got {type(source).__name__}")
    source = check_adapter(source, argument)
    config = PeftConfig.from_pretrained(source)
    return config, load_peft_weights(source, device="cpu")


def merged_adapter_model(
    base_model: torch.nn.Module, source: str | os.PathLike, argument: str = "adapter"
) -> torch.nn.Module:
    """`base_model` (changed in place) with the adapter at `source` merged in (`merge_and_unload`).

    The adapter is checked against the base first (`check_adapter_fits`): one made for another
    base is named with the module and both shapes, not with peft's state-dict dump.
    """
    config, state_dict = read_adapter(source, argument)
    check_adapter_fits(str(source), config, state_dict, base_model)
    return PeftModel.from_pretrained(base_model, str(source)).merge_and_unload()


def check_adapter_fits(
    name: str, config: PeftConfig, state_dict: Mapping[str, torch.Tensor], base_model: torch.nn.Module
) -> None:
    """Raise a ValueError naming the module and both shapes if the adapter was made for another base."""
    if config.peft_type != PeftType.LORA:
        raise ValueError(
            f"adapter `{name}` is of type {config.peft_type}; only LoRA adapters can share one base "
            "in a mixed-adapter batch"
        )
    modules = dict(base_model.named_modules())
    for key, tensor in state_dict.items():
        match = _LORA_KEY.match(key)
        if match is None:
            continue
        module_path = match["module"]
        module = modules.get(module_path)
        if module is None:
            raise ValueError(
                f"adapter `{name}` targets module `{module_path}`, which the given base model "
                f"({type(base_model).__name__}) does not have; was it made for another base?"
            )
        if hasattr(module, "get_base_layer"):  # already wrapped by an earlier adapter's LoRA layer
            module = module.get_base_layer()
        weight = getattr(module, "weight", None)
        if weight is None:
            continue
        out_features, in_features = weight.shape[0], weight.shape[-1]
        # Embeddings and transformers' Conv1D (GPT-2) store their weight as (in, out).
        if type(module).__name__ in ("Embedding", "Conv1D") or isinstance(module, torch.nn.Embedding):
            in_features, out_features = weight.shape[0], weight.shape[1]
        expected = in_features if match["part"] == "A" else out_features
        got = tensor.shape[-1] if match["part"] == "A" else tensor.shape[0]
        if got != expected:
            raise ValueError(
                f"adapter `{name}` was made for another base: its `{key}` has shape "
                f"{tuple(tensor.shape)}, but the base's `{module_path}.weight` has shape "
                f"{tuple(weight.shape)}"
            )


def check_adapter_names(names: Sequence[object]) -> None:
    """Raise a ValueError unless every name can be a peft adapter name beside the reserved `__base__`."""
    for name in names:
        if not isinstance(name, str) or not _NAME_PATTERN.match(name) or name == "__base__":
            raise ValueError(
                f"adapter name {name!r} is not allowed: use letters, digits, '_' or '-', "
                "not starting with a digit, and not '__base__'"
            )


class TrainingFlags:
    """The train/eval mode of every module and `requires_grad` of every parameter of a model.

    Injecting adapters changes both on the caller's model (peft freezes the base, and the
    composition runs in eval mode); `restore()` puts back what was captured.
    """

    def __init__(self, model: torch.nn.Module):
        self.training = [(module, module.training) for module in model.modules()]
        self.requires_grad = [(parameter, parameter.requires_grad) for parameter in model.parameters()]

    def restore(self) -> None:
        for module, training in self.training:
            module.training = training
        for parameter, requires_grad in self.requires_grad:
            parameter.requires_grad_(requires_grad)


def load_adapters_on_base(base_model: torch.nn.Module, adapters: Mapping[str, object]) -> tuple[PeftModel, list[str]]:
    """Inject every adapter into `base_model` (in place) and return the PeftModel and the names.

    If an adapter cannot be loaded, the ones already injected are unloaded and `base_model` is
    left as it was before the error is raised. `PeftModel.unload()` (no merge) undoes a success.
    """
    names = list(adapters)
    if not names:
        raise ValueError("`adapters` must name at least one adapter (name -> folder, hub id or PeftModel), got none")
    check_adapter_names(names)
    for name in names:  # every folder checked before the first one is injected
        source = adapters[name]
        if isinstance(source, (str, os.PathLike)):
            check_adapter(os.fspath(source), f"adapters[{name!r}]")
    flags = TrainingFlags(base_model)
    peft_model: PeftModel | None = None
    try:
        for name in names:
            config, state_dict = read_adapter(adapters[name], f"adapters[{name!r}]")
            check_adapter_fits(name, config, state_dict, base_model)
            config = copy.deepcopy(config)
            config.inference_mode = True
            if peft_model is None:
                peft_model = PeftModel(base_model, config, adapter_name=name)
            else:
                peft_model.add_adapter(name, config)
            result = set_peft_model_state_dict(peft_model, state_dict, adapter_name=name)
            # peft annotates its result as "namedtuple"; it is torch's `_IncompatibleKeys`.
            missing_keys: list[str] = result.missing_keys  # type: ignore[attr-defined]
            missing = [key for key in missing_keys if f".{name}." in key or key.endswith(f".{name}")]
            missing = [key for key in missing if "lora_" in key]
            if missing:
                raise ValueError(f"adapter `{name}` is missing weights for {missing[:3]} ...")
    except Exception:
        if peft_model is not None:
            peft_model.unload()
        flags.restore()
        raise
    peft_model = cast(PeftModel, peft_model)  # set by the first adapter (callers refuse an empty `adapters`)
    peft_model.eval()
    return peft_model, names
