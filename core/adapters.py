"""Load several peft LoRA adapters onto one base model, after checking that each fits it."""

from __future__ import annotations

import copy
import json
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from peft import PeftConfig, PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
from peft.utils import PeftType, load_peft_weights

from mergecompose.core import sources
from mergecompose.core.boundary import check_adapter, check_json_file, check_safetensors_header

_NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")
# "base_model.model.<module path>.lora_A.weight" (adapter_name stripped on save).
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")
# Where a base folder records which model it is: config.json's `_name_or_path` (older transformers wrote it) and
# the provenance file of `mergecompose fetch-model` / `convert-gguf` (integrations/gguf; core reads it by name).
_PROVENANCE_FILE = "conversion.json"
_HUB_CACHE_FOLDER = re.compile(r"^models--(?P<owner>.+?)--(?P<name>.+)$")  # huggingface_hub's cache layout


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
            _check_saved_whole(name, key, tensor, modules)
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
        shape = tuple(weight.shape)
        if isinstance(module, torch.nn.Linear):
            # Its declared shape: a composition that is open on this base holds the weight packed, the
            # parameter empty (mergecompose.composition.kernels.packed_weights).
            shape = (module.out_features, module.in_features)
        out_features, in_features = shape[0], shape[-1]
        # Embeddings and transformers' Conv1D (GPT-2) store their weight as (in, out).
        if type(module).__name__ in ("Embedding", "Conv1D") or isinstance(module, torch.nn.Embedding):
            in_features, out_features = shape[0], shape[1]
        expected = in_features if match["part"] == "A" else out_features
        got = tensor.shape[-1] if match["part"] == "A" else tensor.shape[0]
        if got != expected:
            raise ValueError(
                f"adapter `{name}` was made for another base: its `{key}` has shape "
                f"{tuple(tensor.shape)}, but the base's `{module_path}.weight` has shape {shape}"
            )


def check_adapter_fits_checkpoint(
    adapter: str | os.PathLike[str], base: str | os.PathLike[str], name: str = "adapter"
) -> None:
    """Before any weights load: raise a ValueError naming the adapter (`name`), the tensor and both shapes if the LoRA
    factors of the local
    `adapter` do not fit the local checkpoint `base`, both read from their safetensors headers (the check
    `check_adapter_fits` makes once the base is loaded). Hub ids and weights that are not safetensors are left to
    that check. A factor is compared with either side of the base weight: transformers' Conv1D stores (in, out)."""
    weights = Path(adapter).expanduser() / "adapter_model.safetensors"
    base_shapes = _checkpoint_shapes(Path(base).expanduser())
    if not base_shapes or not weights.exists():
        return
    for key, record in check_safetensors_header(weights, name).items():
        match = _LORA_KEY.match(key)
        if match is None or not isinstance(record, dict):
            continue
        module = match["module"]
        shape = base_shapes.get(f"{module}.weight")
        if shape is None:
            raise ValueError(
                f"adapter `{name}` targets module `{module}`, which the base checkpoint {str(base)!r} does not have; "
                "was it made for another base?"
            )
        factor = tuple(record["shape"])
        got = factor[-1] if match["part"] == "A" else factor[0]
        if len(shape) == 2 and got not in shape:
            raise ValueError(
                f"adapter `{name}` was made for another base: its `{key}` has shape {factor}, but the base's "
                f"`{module}.weight` has shape {shape}"
            )


def _checkpoint_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of a local safetensors checkpoint (one file or shards), from the headers; {} otherwise."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        files = [folder / name for name in sorted(set(check_json_file(index, "base").get("weight_map", {}).values()))]
    else:
        return {}
    return {
        name: tuple(record["shape"])
        for file in files
        for name, record in check_safetensors_header(file, "base").items()
        if name != "__metadata__"
    }


def recorded_base(adapter: object, argument: str = "adapter") -> str | None:
    """The base an adapter records (`base_model_name_or_path` in adapter_config.json), or None if none is.

    `adapter` is a folder or hub id (checked first, `check_adapter`; only its config is read) or a PeftModel."""
    if isinstance(adapter, PeftModel):
        value = adapter.peft_config[adapter.active_adapter].base_model_name_or_path
    elif isinstance(adapter, (str, os.PathLike)):
        source = check_adapter(adapter, argument)
        if sources.is_local(source):
            value = check_json_file(Path(source).expanduser() / sources.ADAPTER_CONFIG, argument).get(
                "base_model_name_or_path"
            )
        else:
            value = PeftConfig.from_pretrained(source).base_model_name_or_path
    else:
        return None  # not an adapter at all: `read_adapter` names it
    return value if isinstance(value, str) and value.strip() else None


def is_other_base(recorded: str | None, base: str | os.PathLike[str] | torch.nn.Module) -> bool:
    """Whether `recorded` (an adapter's recorded base) clearly names another model than `base`.

    `base` is a folder, a hub id, or a model (its `name_or_path`, where transformers loaded it from). Compared:
    local folders, resolved (a recorded path to the base folder matches however it is written), and model names,
    normalised to the lower-case letters and digits of a hub id's last part: the hub id itself, a folder's name,
    a hub-cache folder `models--owner--name`, and what a base folder records, config.json's `_name_or_path` and
    `conversion.json`'s `model` and `gguf_file`. Any common name is a match. It is clearly another model when
    nothing matches and either both are existing folders, or both sides record a name (more than a folder's
    name, which says little). Nothing recorded (None, or a model built in memory): False.
    """
    if recorded is None:
        return False
    adapter_side, base_side = _origin(recorded), _origin(_source_text(base))
    if adapter_side.folder is not None and adapter_side.folder == base_side.folder:
        return False
    if adapter_side.names & base_side.names:
        return False
    both_folders = adapter_side.folder is not None and base_side.folder is not None
    return both_folders or (adapter_side.recorded and base_side.recorded)


def warn_if_made_for_another_base(
    adapter: object, base: str | os.PathLike[str] | torch.nn.Module, argument: str = "adapter"
) -> None:
    """Warn (a UserWarning naming both) if the base `adapter` records clearly names another model than `base`.

    An adapter made for another base of the same shapes loads without an error; only its record can tell
    (`is_other_base`). A warning, not an error: records go stale (a path on the training machine, a renamed
    or mirrored repository), and the shapes are checked anyway (`check_adapter_fits`). Reads configs only.
    """
    recorded = recorded_base(adapter, argument)
    if is_other_base(recorded, base):
        warnings.warn(
            f"`{argument}` records its base as {recorded!r} (`base_model_name_or_path` in adapter_config.json), "
            f"but the base given is {_source_text(base) or type(base).__name__!r}: an adapter made for another base "
            "of the same shapes loads without an error and adds a meaningless delta; give the base it was trained on",
            UserWarning,
            stacklevel=3,
        )


@dataclass(frozen=True)
class _Origin:
    """Which model a base, or an adapter's recorded base, is."""

    folder: Path | None  # the existing local folder, resolved
    names: frozenset[str]  # normalised model names (`_normalised`)
    recorded: bool  # whether a name was recorded (a hub id, a config, a provenance file), not only a folder's name


def _source_text(base: str | os.PathLike[str] | torch.nn.Module) -> str:
    if isinstance(base, torch.nn.Module):
        name = getattr(base, "name_or_path", "") or getattr(getattr(base, "config", None), "_name_or_path", "")
        return name if isinstance(name, str) else ""
    return os.fspath(base)


def _normalised(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.rstrip("/").rsplit("/", 1)[-1].lower())


def _origin(source: str) -> _Origin:
    text = source.strip().rstrip("/")
    if not text:
        return _Origin(None, frozenset(), False)
    if not sources.is_local(text):  # a hub id
        return _Origin(None, frozenset({_normalised(text)}), True)
    path = Path(text).expanduser()
    recorded = [match["name"] for part in path.parts if (match := _HUB_CACHE_FOLDER.match(part))]
    folder = path.resolve() if path.is_dir() else None
    if folder is not None:
        recorded += _recorded_names(folder)
    names = {_normalised(name) for name in [*recorded, path.name]} - {""}
    return _Origin(folder, frozenset(names), bool(recorded))


def _recorded_names(folder: Path) -> list[str]:
    """The model names a base folder records: config.json's `_name_or_path`, the GGUF provenance's model and file."""
    name_or_path = _json_object(folder / sources.CONFIG).get("_name_or_path")
    provenance = _json_object(folder / _PROVENANCE_FILE)
    names = [provenance.get("model"), str(provenance.get("gguf_file") or "").split(".")[0]]
    if isinstance(name_or_path, str) and name_or_path.strip() and not sources.is_local(name_or_path):
        names.append(name_or_path)
    return [name for name in names if isinstance(name, str) and name]


def _json_object(file: Path) -> dict[str, Any]:
    """The JSON object in `file`, or {} (a missing or broken record says nothing; the loaders check the files)."""
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def saved_tensor_mismatch(
    name: str, key: str, shape: Sequence[int], base_name: str, base_shape: Sequence[int]
) -> str | None:
    """Why adapter `name`'s tensor `key`, saved whole (`modules_to_save`), cannot replace the base's `base_name`
    (other shapes; for an embedding, the two vocabulary sizes), or None if the shapes agree."""
    shape, base_shape = tuple(shape), tuple(base_shape)
    if shape == base_shape:
        return None
    problem = (
        f"adapter `{name}` saves `{key}` whole with shape {shape}, but the base's `{base_name}` has shape {base_shape}"
    )
    if len(shape) == len(base_shape) == 2 and shape[1:] == base_shape[1:]:
        problem += (
            f": a vocabulary of {shape[0]} rows against the base's {base_shape[0]} (the adapter was trained with "
            "resized embeddings); give the base resized the same way, or an adapter of the base's vocabulary"
        )
    return problem


def _check_saved_whole(name: str, key: str, tensor: torch.Tensor, modules: Mapping[str, torch.nn.Module]) -> None:
    """A tensor the adapter saves whole (`modules_to_save`: e.g. resized embeddings) has its base tensor's shape."""
    if "lora_" in key:
        return  # a LoRA tensor `_LORA_KEY` does not parse (embedding LoRA, DoRA magnitudes): peft checks those
    base_name = key.removeprefix("base_model.model.")
    module_path, _, attribute = base_name.rpartition(".")
    module = modules.get(module_path)
    if module is None:
        return  # a module the base lacks: peft names it
    original = getattr(module, "original_module", None)  # a copy peft already wraps (ModulesToSaveWrapper)
    if isinstance(original, torch.nn.Module):
        module = original
    base = getattr(module, attribute, None)
    if isinstance(base, torch.Tensor):
        problem = saved_tensor_mismatch(name, key, tensor.shape, base_name, base.shape)
        if problem is not None:
            raise ValueError(problem)


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
