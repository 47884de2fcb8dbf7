"""What checkpoints record about their vocabulary, read before any weights load, and the models that compose
over the vocabulary they share when some of them carry padded rows.

Checkpoints whose embeddings were resized to a multiple of 64 are common (MergeBench's Llama experts have
128,320 rows against the base's 128,256). The rows beyond the tokenizer are padding: no prompt holds their
ids, and a composition rules them out (`shared_vocabulary`, `SharedVocabulary`).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PreTrainedModel

from mergecompose.core import sources
from mergecompose.core.adapters import saved_tensor_mismatch
from mergecompose.core.boundary import ADAPTER_SAFETENSORS, check_safetensors_header
from mergecompose.merging.lazy_tensors import SafetensorsCheckpoint


def shared_vocabulary(sizes: Sequence[tuple[str, int]], tokenizer_size: int | None) -> int:
    """The vocabulary a composition runs over, V, from each component's (name, output rows), base first.

    Equal sizes: that size. Otherwise the smallest, provided every id the tokenizer can produce lies below it
    (`tokenizer_size`, its largest id + 1): the larger checkpoints' extra rows are then padding, ruled out as if
    their log-prob were −inf, and every component renormalises over the shared ids. Without a tokenizer, or
    with one that reaches into the extra rows (real tokens only some components know), a ValueError names
    both checkpoints and both sizes.
    """
    smallest = min(sizes, key=lambda item: item[1])
    largest = max(sizes, key=lambda item: item[1])
    if smallest[1] == largest[1]:
        return smallest[1]
    mismatch = f"vocabulary size mismatch: {largest[0]} has {largest[1]} output tokens, {smallest[0]} has {smallest[1]}"
    if tokenizer_size is None:
        raise ValueError(
            f"{mismatch}; without a tokenizer the extra rows cannot be told apart from padding: give the "
            "tokenizer, or experts that share the base's vocabulary"
        )
    if tokenizer_size > smallest[1]:
        raise ValueError(
            f"{mismatch}, and the tokenizer has ids up to {tokenizer_size - 1}: rows from {smallest[1]} on are "
            "real tokens, not padding; experts must share the base's vocabulary"
        )
    return smallest[1]


def tokenizer_size(tokenizer: Any) -> int | None:
    """The number of ids `tokenizer` can produce (its largest id + 1, added tokens included), or None."""
    if tokenizer is None:
        return None
    vocabulary = tokenizer.get_vocab()
    return max(vocabulary.values()) + 1 if vocabulary else 0


def config_vocab_size(source: str | os.PathLike[str], trust_remote_code: bool = False) -> int | None:
    """The `vocab_size` a checkpoint's config.json records (its text config's, for a multimodal one), or None."""
    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    size = getattr(config.get_text_config(), "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def checkpoint_vocabulary(
    base: str,
    experts: Sequence[str | os.PathLike[str]],
    is_adapter: Sequence[bool],
    tokenizer: Any,
    trust_remote_code: bool = False,
) -> int | None:
    """`shared_vocabulary` of a base and its full experts from their configs, before any weights load (None if
    a config records no size). An adapter expert runs on the base's own embeddings: it adds no size."""
    sizes = [(f"`base` {base!r}", config_vocab_size(base, trust_remote_code))]
    sizes += [
        (f"`experts[{index}]` {os.fspath(expert)!r}", config_vocab_size(expert, trust_remote_code))
        for index, (expert, adapter) in enumerate(zip(experts, is_adapter))
        if not adapter
    ]
    known = [(argument, size) for argument, size in sizes if size is not None]
    if len(known) < len(sizes):
        return None  # the sizes are checked on the loaded models (`check_vocabularies`)
    return shared_vocabulary(known, tokenizer_size(tokenizer))


def check_saved_tensors_fit(base: str, adapter: str | os.PathLike[str], argument: str) -> None:
    """Before any weights load: the tensors an adapter saves whole (`modules_to_save`, e.g. embeddings resized
    for new tokens) must have the shapes of the base's tensors of the same name, both read from file headers;
    a ValueError names the tensor and both shapes (both vocabulary sizes for an embedding). Only a local base of
    safetensors files and a local adapter_model.safetensors are read here; otherwise `check_adapter_fits`
    checks the same on the loaded base."""
    adapter_file = Path(os.fspath(adapter)).expanduser() / ADAPTER_SAFETENSORS
    if not (sources.is_local(base) and sources.is_local(adapter_file) and adapter_file.is_file()):
        return
    folder = Path(base).expanduser()
    if not any((folder / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        return
    checkpoint = SafetensorsCheckpoint(folder, "base")
    for key, record in check_safetensors_header(adapter_file, argument).items():
        base_name = key.removeprefix("base_model.model.")
        if key == "__metadata__" or "lora_" in key or base_name not in checkpoint:
            continue
        problem = saved_tensor_mismatch(argument, key, record["shape"], base_name, checkpoint.shape(base_name))
        if problem is not None:
            raise ValueError(problem)


def with_vocabulary(model: PreTrainedModel, vocabulary: int) -> PreTrainedModel:
    """`model` itself if it has `vocabulary` output rows; else a new model of its class and config (with
    `vocab_size` = `vocabulary`) holding its tensors, the input and output embeddings (and an output bias) cut
    to their first `vocabulary` rows. The cut rows are views, nothing is copied, and `model` is not changed."""
    output = model.get_output_embeddings()
    if output is None or output.weight.shape[0] <= vocabulary:
        return model
    embeddings = [output.weight, getattr(output, "bias", None), model.get_input_embeddings().weight]
    cut = {(tensor.data_ptr(), tuple(tensor.shape)) for tensor in embeddings if isinstance(tensor, torch.Tensor)}
    state = {
        name: tensor[:vocabulary] if (tensor.data_ptr(), tuple(tensor.shape)) in cut else tensor
        for name, tensor in model.state_dict().items()
    }
    config = copy.deepcopy(model.config)
    config.get_text_config().vocab_size = vocabulary
    with torch.device("meta"):
        new = type(model)(config)
    new.load_state_dict(state, strict=True, assign=True)
    saved = set(state)
    for name, buffer in model.named_buffers():
        if name not in saved:  # a buffer that is not saved, e.g. RoPE's inverse frequencies
            module_path, _, attribute = name.rpartition(".")
            new.get_submodule(module_path)._buffers[attribute] = buffer
    new.generation_config = model.generation_config
    return new.train(model.training).requires_grad_(False)
