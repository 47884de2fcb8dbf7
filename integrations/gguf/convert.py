"""A GGUF file as an ordinary Hugging Face folder: safetensors, tokenizer, chat template, generation config.

transformers reads a GGUF file and dequantizes its tensors (`from_pretrained(folder, gguf_file=…)`, which
needs the `gguf` package); the model it returns carries a `quantization_config` that names the GGUF file,
so its weights are copied into a fresh model of the same configuration without it, and saved from there.
The folder is written atomically, with `conversion.json` (what it was made from, with which versions) and
a manifest of file sizes (`mergecompose.core.io.write_manifest`) written last.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import struct
from importlib.metadata import version
from pathlib import Path

import torch
from gguf import GGUFReader
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint

from mergecompose.core.boundary import check_gguf_file
from mergecompose.core.io import (
    atomic_output_dir,
    atomic_write_text,
    refuse_existing,
    refuse_output_over_inputs,
    write_manifest,
)

PROVENANCE_NAME = "conversion.json"
# transformers' table has two sections that are not architectures.
SUPPORTED_ARCHITECTURES = tuple(name for name in GGUF_SUPPORTED_ARCHITECTURES if name not in ("general", "tokenizer"))


def check_convertible(gguf_file: str | os.PathLike, argument: str = "gguf_file") -> tuple[Path, str]:
    """`gguf_file` as a Path and its architecture, after checking (without dequantizing anything) that it is
    a complete GGUF file whose architecture transformers can dequantize.

    Complete: its header (`check_gguf_file`), then its metadata and every tensor's bytes as gguf's `GGUFReader`
    maps them (a file cut short fails there). Supported: a name in `SUPPORTED_ARCHITECTURES` (transformers'
    table), or one that transformers' metadata reader (`load_gguf_checkpoint` without tensors) accepts.
    """
    path = check_gguf_file(gguf_file, argument)
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, struct.error) as error:
        raise ValueError(
            f"`{argument}` {str(gguf_file)!r} is truncated or corrupt: gguf cannot read its metadata and tensors "
            f"({' '.join(str(error).split())}); expected a complete GGUF file"
        ) from None
    architecture = _architecture(reader, argument, gguf_file)
    if architecture in SUPPORTED_ARCHITECTURES:
        return path, architecture
    # Another name may still be one transformers maps to a supported one (qwen2moe, gpt-oss, t5encoder):
    # its metadata reader decides, and refuses the others before reading any tensor.
    try:
        load_gguf_checkpoint(str(path), return_tensors=False)
    except (ValueError, KeyError, IndexError, TypeError) as error:
        if not isinstance(error, ValueError) or "not supported" not in str(error):
            raise ValueError(
                f"`{argument}` {str(gguf_file)!r}: transformers cannot read its metadata "
                f"({type(error).__name__}: {' '.join(str(error).split())}); expected a GGUF model file"
            ) from None
        raise ValueError(
            f"`{argument}` {str(gguf_file)!r} holds a model of architecture {architecture!r}, which transformers "
            f"{version('transformers')} cannot dequantize; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None
    return path, architecture


def _architecture(reader: GGUFReader, argument: str, gguf_file: str | os.PathLike) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError(
            f"`{argument}` {str(gguf_file)!r} has no `general.architecture` in its metadata; expected a GGUF model"
        )
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def load_gguf(gguf_file: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """transformers' dequantized model (float32) and tokenizer of a checked GGUF file."""
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    return model, tokenizer


def plain_model(model: PreTrainedModel) -> PreTrainedModel:
    """A model of `model`'s configuration, without the GGUF `quantization_config`, holding `model`'s tensors."""
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = ""
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    plain.load_state_dict(model.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = copy.deepcopy(model.generation_config)
    return plain.eval()


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def convert_gguf(
    gguf_file: str | os.PathLike,
    out_dir: str | os.PathLike,
    overwrite: bool = False,
    provenance: dict | None = None,
) -> Path:
    """Write the Hugging Face folder `out_dir` (model.safetensors in float32, config, generation config,
    tokenizer, chat template) of the GGUF file `gguf_file`; return `out_dir` as a Path.

    `conversion.json` records the GGUF file's name and sha256, its architecture, the transformers and gguf
    versions used, and `provenance` (e.g. the package the file came from). Everything is checked before
    the model loads (`check_convertible`, and an existing `out_dir` is refused unless `overwrite`); the folder
    appears under its name only when complete.
    """
    path, architecture = check_convertible(gguf_file, "gguf_file")
    out_dir = refuse_existing(out_dir, overwrite)
    refuse_output_over_inputs(out_dir, [gguf_file])
    record = {
        "gguf_file": path.name,
        "gguf_sha256": sha256_file(path),
        "architecture": architecture,
        "transformers_version": version("transformers"),
        "gguf_version": version("gguf"),
        **(provenance or {}),
    }
    model, tokenizer = load_gguf(path)
    with atomic_output_dir(out_dir, overwrite) as temporary:
        plain_model(model).save_pretrained(temporary)
        tokenizer.save_pretrained(temporary)
        atomic_write_text(temporary / PROVENANCE_NAME, json.dumps(record, indent=1) + "\n")
        write_manifest(temporary)
    return out_dir
