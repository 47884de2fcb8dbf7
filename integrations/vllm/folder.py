"""The model folder that serves a composition in vLLM: `build_vllm_model` (`mergecompose vllm-model`).

A small folder, no copy of any checkpoint:

* `config.json`: the base's config, with `architectures: ["MergeComposeForCausalLM"]` (the class
  `mergecompose.integrations.vllm.plugin` registers with vLLM) and a `composition` section: the base's own
  architecture, each component's absolute path and kind (full checkpoint or LoRA adapter), the
  weights `w_i` of `log p̂ = log p_b + Σ_i w_i (log p_i − log p_b)`;
* the base's tokenizer files (and generation config), so that vLLM, its server and lm-eval read the
  base's tokenizer;
* `composition.safetensors`: the weights as one tensor. vLLM refuses a folder without weight files; the
  components' own weights are read from their folders (`mergecompose.integrations.vllm.composite_model`).

Everything a user can get wrong is checked here, before vLLM starts and before anything is written: an expert name a
request could not give (`choice.expert_name_problem`), a missing path, a folder that is neither a checkpoint nor an
adapter, experts whose config or tokenizer differ from the base's, an adapter made for another base or of a kind the
vLLM model does not run (DoRA, LoRA on embeddings). Then every weight file of the base and the experts is read, one
tensor at a time: a file that is truncated or not safetensors, a tensor holding NaN or inf, or a full expert's
tensor whose name or shape is not the base's is refused, naming the component and the tensor.
This module does not import vLLM: the folder is built in any environment with mergecompose.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from peft import PeftType
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from mergecompose.composition.rule import check_weights
from mergecompose.core.adapters import check_adapter_fits, read_adapter
from mergecompose.core.boundary import InputFileError, check_adapter, check_safetensors_file
from mergecompose.core.io import atomic_output_dir, refuse_output_over_inputs
from mergecompose.integrations.vllm.choice import expert_name_problem, quote
from mergecompose.integrations.vllm.plugin import ARCHITECTURE
from mergecompose.merging.state_dicts import check_finite

PLACEHOLDER_WEIGHTS = "composition.safetensors"
# Files of a tokenizer (any of them) and the generation defaults vLLM reads beside config.json.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
# The LoRA targets the vLLM model runs: the attention and MLP projections of Llama-family and Gemma-2 models.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Config fields that may differ between a base and a full expert fine-tuned from it.
_CONFIG_FIELDS_THAT_MAY_DIFFER = {
    "_name_or_path",
    "architectures",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "_attn_implementation_autoset",
}
NONFINITE_HINT = "the vLLM model would compose NaN log-probabilities; give a component with finite weights"


def build_vllm_model(
    out_dir: str | os.PathLike,
    base: str | os.PathLike,
    experts: Sequence[str | os.PathLike],
    weights: Sequence[float] | None = None,
    names: Sequence[str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the vLLM model folder of `base` composed with `experts` (full checkpoints or peft LoRA adapters).

    Args:
        out_dir: the folder to write (refused if it exists, unless `overwrite`).
        base: a local model folder with safetensors weights and a tokenizer.
        experts: local folders, each a full checkpoint of the base's architecture or a LoRA adapter of it.
        weights: one exponent `w_i` per expert (default 1.0 each, the paper's rule).
        names: one name per expert (default: the folder names), the name a request gives in `vllm_xargs`'s
            `experts`: a non-empty string without a comma or leading or trailing space.

    Returns the folder, ready for `vllm.LLM(model=out_dir)` or `vllm serve out_dir` in an environment
    with vLLM and mergecompose. Raises ValueError or OSError naming the argument, the value and what is
    allowed, before anything is written.
    """
    if isinstance(experts, (str, os.PathLike)) or len(experts) == 0:
        raise ValueError(f"`experts` must be a list of at least one checkpoint or adapter folder, got {experts!r}")
    weights = check_weights(weights, len(experts)) or [1.0] * len(experts)
    names = _expert_names(experts, names)
    base_folder = _local_folder(base, "base")
    base_config = _read_config(base_folder, "base")
    _check_safetensors(base_folder, "base")
    base_tokenizer = _load_tokenizer(base_folder)
    if base_tokenizer is None:
        raise ValueError(
            f"`base` {str(base)!r} has no tokenizer files (one of {', '.join(TOKENIZER_FILES[:5])}); "
            "vLLM needs the base's tokenizer"
        )
    components = []
    full_experts: dict[str, Path] = {}  # argument -> folder
    for index, (expert, name) in enumerate(zip(experts, names)):
        argument = f"experts[{index}]"
        folder = _local_folder(expert, argument)
        if (folder / "adapter_config.json").is_file():
            components.append(
                {"name": name, "path": str(folder), "kind": "lora", **_check_lora(folder, argument, base_folder)}
            )
        elif (folder / "config.json").is_file():
            _check_full_expert(folder, argument, base_config, base_folder, base_tokenizer)
            components.append({"name": name, "path": str(folder), "kind": "full"})
            full_experts[argument] = folder
        else:
            raise ValueError(
                f"`{argument}` {str(expert)!r} is neither a model folder (config.json) nor a peft adapter "
                f"folder (adapter_config.json); it holds {sorted(p.name for p in folder.iterdir())[:8]}"
            )
    refuse_output_over_inputs(out_dir, [base, *experts], "`out_dir`")
    base_shapes = _check_weights(base_folder, "base")
    for argument, folder in full_experts.items():
        _check_weights(folder, argument, base_shapes)

    config = dict(base_config)
    config["architectures"] = [ARCHITECTURE]
    config["composition"] = {
        "base": str(base_folder),
        "base_architecture": base_config["architectures"][0],
        "experts": components,
        "weights": weights,
    }
    with atomic_output_dir(out_dir, overwrite=overwrite) as folder:
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for file_name in TOKENIZER_FILES:
            if (base_folder / file_name).is_file():
                shutil.copyfile(base_folder / file_name, folder / file_name)
        save_file(
            {"composition.weights": torch.tensor(weights, dtype=torch.float32)}, str(folder / PLACEHOLDER_WEIGHTS)
        )
    return Path(out_dir)


def _expert_names(experts: Sequence, names: Sequence[str] | None) -> list[str]:
    """One name per expert, each a name a request can give in `experts` (`choice.expert_name_problem`): the
    `names` given, or the folders' names (suffixed with their index where two are the same)."""
    if names is None:
        names = [Path(os.fspath(expert)).name or f"expert_{index}" for index, expert in enumerate(experts)]
        if len(set(names)) != len(names):
            names = [f"{name}_{index}" for index, name in enumerate(names)]
        for index, name in enumerate(names):
            problem = expert_name_problem(name)
            if problem:
                raise ValueError(
                    f"`experts[{index}]`'s folder name {quote(name)} {problem}, so a request could not name it: "
                    "give the experts names with `names` (`--names` on the command line)"
                )
    names = list(names)
    if len(names) != len(experts):
        raise ValueError(f"`names` must hold one name per expert ({len(experts)}), got {quote(names)}")
    for index, name in enumerate(names):
        problem = expert_name_problem(name)
        if problem:
            raise ValueError(
                f"`names[{index}]` {quote(name)} {problem}: an expert's name is what a request gives in `experts`, "
                "a non-empty string without a comma or leading or trailing space"
            )
    if len(set(names)) != len(names):
        raise ValueError(f"`names` must be unique, got {quote(names)}")
    return names


def _local_folder(source, argument: str) -> Path:
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"`{argument}` must be a local folder, got {type(source).__name__}")
    path = Path(os.fspath(source)).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"`{argument}` {str(source)!r}: no such folder (the vLLM model folder needs local components)"
        )
    if not path.is_dir():
        raise NotADirectoryError(f"`{argument}` {str(source)!r} is a file; give a model or adapter folder")
    return path.resolve()


def _read_config(folder: Path, argument: str) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        hint = " (it is a peft adapter: give its base as `base`)" if (folder / "adapter_config.json").is_file() else ""
        raise ValueError(f"`{argument}` {str(folder)!r} is not a model folder: it has no config.json{hint}")
    config = json.loads(path.read_text())
    architectures = config.get("architectures") or []
    if len(architectures) != 1:
        raise ValueError(f"`{argument}` {str(folder)!r}: config.json must name one architecture, got {architectures!r}")
    if architectures[0] == ARCHITECTURE:
        raise ValueError(f"`{argument}` {str(folder)!r} is itself a composed vLLM model folder; give its components")
    return config


def _check_safetensors(folder: Path, argument: str) -> None:
    if not any(folder.glob("*.safetensors")):
        raise ValueError(
            f"`{argument}` {str(folder)!r} has no .safetensors weights; the vLLM model reads only "
            "safetensors (save the model with `save_pretrained(..., safe_serialization=True)`)"
        )


def _weight_files(folder: Path, argument: str) -> list[Path]:
    """The safetensors files vLLM reads: those of model.safetensors.index.json if there is one, else every one."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return sorted({folder / file_name for file_name in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as error:
            raise InputFileError(
                argument,
                index,
                f"is not a readable safetensors index ({type(error).__name__}: {error})",
                'JSON with a "weight_map" of tensor names to files',
            ) from None
    return sorted(folder.glob("*.safetensors"))


def _check_weights(
    folder: Path, argument: str, base_shapes: dict[str, tuple[int, ...]] | None = None
) -> dict[str, tuple[int, ...]]:
    """Read every tensor of the checkpoint `folder`, one at a time: whole files, finite values, and (for an
    expert, given `base_shapes`) the base's tensor names and shapes. Returns {tensor name: shape}."""
    shapes: dict[str, tuple[int, ...]] = {}
    where = f"`{argument}` {str(folder)!r}"
    for path in _weight_files(folder, argument):
        check_safetensors_file(path, argument)
        try:
            handle = safe_open(str(path), framework="pt")
        except SafetensorError as error:
            # The header parsed (check_safetensors_file) but safetensors refuses it, e.g. an unknown dtype.
            raise InputFileError(argument, path, f"cannot be opened by safetensors ({error})") from None
        for name in handle.keys():
            tensor = handle.get_tensor(name)  # one tensor alive at a time
            shape = tuple(tensor.shape)
            if base_shapes is not None and name in base_shapes and shape != base_shapes[name]:
                raise ValueError(
                    f"{where}: tensor `{name}` has shape {shape}, the base's {base_shapes[name]}; a full expert "
                    "must hold the base's tensors with the base's shapes"
                )
            check_finite(name, tensor, where, NONFINITE_HINT)
            shapes[name] = shape
    if base_shapes is not None and set(shapes) != set(base_shapes):
        missing, extra = sorted(set(base_shapes) - set(shapes)), sorted(set(shapes) - set(base_shapes))
        raise ValueError(
            f"{where}: its tensors are not the base's (missing {missing[:3]}, not in the base {extra[:3]}); a full "
            "expert must hold the base's tensors with the base's shapes"
        )
    return shapes


def _load_tokenizer(folder: Path):
    if not any((folder / name).is_file() for name in TOKENIZER_FILES[:5]):
        return None
    return AutoTokenizer.from_pretrained(str(folder))


def _check_full_expert(folder: Path, argument: str, base_config: dict, base_folder: Path, base_tokenizer) -> None:
    """A full expert runs with the base's config in vLLM: its config must equal the base's but for bookkeeping."""
    config = _read_config(folder, argument)
    _check_safetensors(folder, argument)
    keys = (set(config) | set(base_config)) - _CONFIG_FIELDS_THAT_MAY_DIFFER
    differing = sorted(key for key in keys if config.get(key) != base_config.get(key))
    if differing:
        details = ", ".join(f"{key}: {config.get(key)!r} (base: {base_config.get(key)!r})" for key in differing[:4])
        noun = "vocabulary" if "vocab_size" in differing else "config"
        raise ValueError(
            f"`{argument}` {str(folder)!r}: its {noun} differs from the base's ({details}); every "
            "component must share the base's architecture and vocabulary"
        )
    tokenizer = _load_tokenizer(folder)
    if tokenizer is not None and tokenizer.get_vocab() != base_tokenizer.get_vocab():
        vocab, base_vocab = tokenizer.get_vocab(), base_tokenizer.get_vocab()
        differing_tokens = sorted(set(vocab.items()) ^ set(base_vocab.items()))[:4]
        raise ValueError(
            f"`{argument}` {str(folder)!r}: its tokenizer ({len(vocab)} tokens) differs from the base's "
            f"({len(base_vocab)} tokens), first differing (token, id) pairs {differing_tokens}; every "
            "component must share the base's tokenizer"
        )


def _check_lora(folder: Path, argument: str, base_folder: Path) -> dict:
    """Check a LoRA adapter against the base (shapes, kind, targets, finite values); return its scaling and
    target modules."""
    check_adapter(folder, argument)  # adapter_config.json and the weight file, before peft reads them
    config, state_dict = read_adapter(str(folder), argument)
    if config.peft_type != PeftType.LORA:
        raise ValueError(
            f"`{argument}` {str(folder)!r} is a {config.peft_type} adapter; the vLLM model runs LoRA adapters only"
        )
    if getattr(config, "use_dora", False):
        raise ValueError(
            f"`{argument}` {str(folder)!r} is a DoRA adapter; the vLLM model runs plain LoRA "
            "(merge it into a full checkpoint and give that instead)"
        )
    if (
        getattr(config, "modules_to_save", None)
        or getattr(config, "rank_pattern", None)
        or getattr(config, "alpha_pattern", None)
    ):
        raise ValueError(
            f"`{argument}` {str(folder)!r} has modules_to_save, rank_pattern or alpha_pattern; the vLLM "
            "model runs one rank and alpha for all modules (merge it into a full checkpoint instead)"
        )
    if not (folder / "adapter_model.safetensors").is_file():
        raise ValueError(
            f"`{argument}` {str(folder)!r} has no adapter_model.safetensors; the vLLM model reads only safetensors"
        )
    targets = sorted({key.split(".lora_")[0].rsplit(".", 1)[-1] for key in state_dict if ".lora_" in key})
    unsupported = [target for target in targets if target not in LORA_TARGETS]
    if unsupported:
        raise ValueError(
            f"`{argument}` {str(folder)!r} adapts {unsupported}; the vLLM model adds LoRA to "
            f"{list(LORA_TARGETS)} only (merge it into a full checkpoint and give that instead)"
        )
    with torch.device("meta"):  # shapes only: the base's modules without its weights
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(base_folder)))
    try:
        check_adapter_fits(str(folder), config, state_dict, skeleton)
    except ValueError as error:
        raise ValueError(f"`{argument}` {str(folder)!r} does not fit `base` {str(base_folder)!r}: {error}") from None
    for name, tensor in state_dict.items():
        check_finite(name, tensor, f"`{argument}` {str(folder)!r}", NONFINITE_HINT)
    scaling = config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)
    return {"lora_scaling": scaling, "lora_targets": targets}
