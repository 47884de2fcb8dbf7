"""`merge_in_memory`: our typed merge config with a user's method (`method: package.module:Name`), on checkpoints.

mergekit runs only its own methods, so a user's method (`mergecompose.merging.user_methods`) merges in
memory: the base and each expert (a full checkpoint, or a LoRA adapter on the base, made dense as
`TaskVector.from_lora`) are loaded, `mergecompose.merging.merge` merges them, and the merged checkpoint is
written atomically: its weights and config.json (`save_pretrained`, in the config's `dtype`), the base's
tokenizer if it has one, our config as `mergecompose_config.yaml` (as `merge_checkpoints` writes it) and the
resolved settings with the SHA-256 of the method's module as `merge_settings.yaml`.

`prepare_in_memory_merge` checks everything first and loads no weights: the config, the method (it imports,
follows the protocol, takes the parameters given), every model folder through the loading boundary, the
checkpoints' agreement (and, unless `allow_nonfinite`, finiteness), and the output folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import yaml
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergecompose.core.boundary import TOKENIZER_FILES, check_checkpoint, check_model_or_adapter, check_text_file
from mergecompose.core.import_paths import is_import_path, source_hash
from mergecompose.core.io import atomic_output_dir, read_yaml_mapping, refuse_existing, refuse_output_over_inputs
from mergecompose.core.sources import is_local
from mergecompose.merging.checkpoints import CheckpointMergeConfig, MergeConfigSource, check_checkpoints
from mergecompose.merging.merge import merge
from mergecompose.merging.method_settings import MergeSettings, readable_error
from mergecompose.merging.task_vector import TaskVector

_ADAPTER_HINT = "give a full checkpoint as `base`; adapters go in `experts`, on that base"


def user_merge_config(config: MergeConfigSource) -> CheckpointMergeConfig | None:
    """Our typed config, validated, if its `method` is an import path (a user's method); otherwise None (the
    config is for mergekit: `mergecompose.merging.checkpoints.load_merge_config` reads it)."""
    if isinstance(config, CheckpointMergeConfig):
        return config if is_import_path(config.method) else None
    if isinstance(config, (str, os.PathLike)):
        config = read_yaml_mapping(check_text_file(config, "config"), "merge config")
    if not isinstance(config, dict) or "merge_method" in config or not is_import_path(config.get("method")):
        return None
    try:
        return CheckpointMergeConfig.model_validate(config)
    except ValidationError as error:
        raise readable_error(error, CheckpointMergeConfig, "the merge config") from None


@dataclass(frozen=True)
class PreparedInMemoryMerge:
    """A user-method merge checked and ready: the config, its resolved settings, the base and each expert's kind."""

    config: CheckpointMergeConfig
    settings: MergeSettings
    base: str
    experts: list[tuple[str, Literal["checkpoint", "adapter"]]]


def prepare_in_memory_merge(
    config: MergeConfigSource, out_dir: str | os.PathLike, overwrite: bool = False, *, allow_nonfinite: bool = False
) -> PreparedInMemoryMerge:
    """Every check of `merge_in_memory`, loading no weights and writing nothing (`mergecompose merge --check`).

    Raises:
        ValueError: the config is not ours with an import path as `method`, the method does not import or does
            not follow the protocol, a parameter it does not take or out of range, a model folder that is
            missing, broken or of the wrong kind, checkpoints that do not agree, or an output over an input.
        FileExistsError: `out_dir` exists and `overwrite` is False.
    """
    ours = user_merge_config(config)
    if ours is None:
        raise ValueError(
            "`config` must be our typed merge config with your method's import path as `method` "
            "(`method: package.module:Name`); mergekit's configs go to `merge_checkpoints`"
        )
    settings = ours.settings()
    base = check_checkpoint(ours.base, "base", adapter_hint=_ADAPTER_HINT)
    experts = [
        (expert.path, check_model_or_adapter(expert.path, f"experts[{index}]"))
        for index, expert in enumerate(ours.experts)
    ]
    full = {"base": base}
    full.update({f"experts[{i}]": path for i, (path, kind) in enumerate(experts) if kind == "checkpoint"})
    check_checkpoints({label: path for label, path in full.items() if is_local(path)}, allow_nonfinite)
    config_file = [config] if isinstance(config, (str, os.PathLike)) else []
    refuse_output_over_inputs(out_dir, [base, *(path for path, _ in experts), *config_file])
    refuse_existing(out_dir, overwrite)
    return PreparedInMemoryMerge(ours, settings, base, experts)


def merge_in_memory(
    config: MergeConfigSource,
    out_dir: str | os.PathLike,
    overwrite: bool = False,
    *,
    allow_nonfinite: bool = False,
    progress: bool = False,
) -> Path:
    """Merge the checkpoints of our typed config with the user's method it names, in memory, into `out_dir`.

    Memory holds the base, the k task vectors and one expert model at a time. The merged model is written
    atomically (nothing at `out_dir` on failure) and loads with `AutoModelForCausalLM.from_pretrained`.
    Raises what `prepare_in_memory_merge` raises, before any weights load, and `merge`'s errors (a non-finite
    result, unless `allow_nonfinite`).
    """
    prepared = prepare_in_memory_merge(config, out_dir, overwrite, allow_nonfinite=allow_nonfinite)
    ours = prepared.config
    base_model = AutoModelForCausalLM.from_pretrained(prepared.base, dtype=torch.float32)
    task_vectors = []
    for path, kind in prepared.experts:
        if kind == "adapter":
            task_vectors.append(TaskVector.from_lora(base_model, path, allow_nonfinite=allow_nonfinite))
        else:
            expert = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            task_vectors.append(TaskVector.from_models(base_model, expert, allow_nonfinite=allow_nonfinite))
            del expert
    parameters = {**(ours.model_extra or {}), "weights": prepared.settings.weights}
    merged = merge(
        ours.method, base_model, task_vectors, progress=progress, allow_nonfinite=allow_nonfinite, **parameters
    )
    base_model.load_state_dict(merged)
    base_model.to(getattr(torch, ours.dtype))
    record = {"settings": prepared.settings.model_dump(), "source_sha256": source_hash(ours.method)}
    with atomic_output_dir(out_dir, overwrite) as folder:
        base_model.save_pretrained(folder)
        if not is_local(prepared.base) or any((Path(prepared.base) / name).exists() for name in TOKENIZER_FILES):
            AutoTokenizer.from_pretrained(prepared.base).save_pretrained(folder)
        (folder / "mergecompose_config.yaml").write_text(yaml.safe_dump(ours.model_dump(), sort_keys=False))
        (folder / "merge_settings.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    return Path(out_dir)
