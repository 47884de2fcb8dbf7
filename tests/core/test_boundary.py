"""The loading boundary (`mergecompose.core.boundary`): each kind of bad file is refused naming the argument and
the file, before anything loads."""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mergecompose.core.boundary import (
    InputFileError,
    check_adapter,
    check_checkpoint,
    check_gguf_file,
    check_json_file,
    check_model_or_adapter,
    check_safetensors_file,
    check_text_file,
    check_tokenizer,
)
from mergecompose.core.io import one_read_per_file, read_utf8, safetensors_problem

ROOT = os.geteuid() == 0  # root reads a file whatever its mode


def _gguf(path, magic=b"GGUF", version=3, tensors=0, metadata=0, extra=b""):
    path.write_bytes(struct.pack("<4sIQQ", magic, version, tensors, metadata) + extra)
    return path


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _complete_gguf(path, version=3):
    """A GGUF file by hand: metadata `general.alignment` (uint32 64) and a names array, then one F32 (2, 3) tensor."""
    metadata = _string(b"general.alignment") + struct.pack("<II", 4, 64)
    metadata += _string(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2) + _string(b"a") + _string(b"b")
    info = _string(b"token_embd.weight") + struct.pack("<IQQIQ", 2, 3, 2, 0, 0)
    _gguf(path, version=version, tensors=1, metadata=2, extra=metadata + info)
    padding = -path.stat().st_size % 64
    with open(path, "ab") as handle:
        handle.write(b"\0" * padding + struct.pack("<6f", *range(6)))
    return path


@pytest.mark.parametrize("version", [2, 3])
def test_a_complete_gguf_file_passes_and_one_cut_anywhere_is_truncated(tmp_path, version):
    path = _complete_gguf(tmp_path / "model.gguf", version)
    assert check_gguf_file(str(path), "gguf") == path
    data = path.read_bytes()
    for keep in (len(data) - 4, len(data) - 24, 40, 70):  # in the tensor data, the padding, the metadata
        path.write_bytes(data[:keep])
        with pytest.raises(InputFileError, match=rf"`gguf` '.*model\.gguf': is truncated: .*{keep} bytes"):
            check_gguf_file(path, "gguf")


def test_a_gguf_file_written_by_gguf_and_cut_in_half_is_truncated(tmp_path):
    gguf = pytest.importorskip("gguf")  # the real-model extra
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.arange(64, dtype=torch.float32).reshape(8, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert check_gguf_file(path, "gguf") == path
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(InputFileError, match=r"is truncated"):
        check_gguf_file(path, "gguf")


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (lambda p: _gguf(p, magic=b"GGML"), r"`gguf` '.*model\.gguf': is not a GGUF file: it starts with b'GGML'"),
        (lambda p: _gguf(p, version=7), r"has GGUF version 7, which this code cannot read"),
        (lambda p: p.write_bytes(b"GGUF\3\0"), r"is truncated: 6 bytes, shorter than a GGUF header"),
        (lambda p: _gguf(p, tensors=2, metadata=1), r"declares 2 tensors and 1 metadata entries.* 24 bytes"),
        (lambda p: _gguf(p, metadata=1, extra=_string(b"k") + struct.pack("<I", 99)), r"metadata value type 99"),
        (lambda p: p.write_bytes(b""), r"is empty; expected a GGUF file"),
        (lambda p: p.mkdir(), r"is a folder, not a file"),
        (lambda p: None, r"does not exist"),
    ],
    ids=["magic", "version", "short", "counts", "value-type", "empty", "folder", "missing"],
)
def test_bad_gguf_files_are_named(tmp_path, content, match):
    path = tmp_path / "model.gguf"
    content(path)
    with pytest.raises(InputFileError, match=match) as caught:
        check_gguf_file(path, "gguf")
    assert caught.value.argument == "gguf" and caught.value.path == str(path)


# ---- checkpoints -------------------------------------------------------------------------------


@pytest.fixture
def checkpoint(checkpoints, tmp_path):
    """A copy of the tiny base checkpoint (config.json, model.safetensors) to break."""
    return shutil.copytree(checkpoints / "base", tmp_path / "base")


def _truncate(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:keep])


def test_a_good_checkpoint_passes_as_given(checkpoint):
    assert check_checkpoint(str(checkpoint), "base") == str(checkpoint)
    assert check_model_or_adapter(checkpoint, "experts[0]") == "checkpoint"


@pytest.mark.parametrize(
    ("breaking", "file", "match"),
    [
        (lambda f: _truncate(f / "model.safetensors", -100), "model.safetensors", r"bytes, its header describes"),
        (lambda f: _truncate(f / "model.safetensors", 20), "model.safetensors", r"shorter than its own header"),
        (lambda f: (f / "model.safetensors").write_bytes(b""), "model.safetensors", r"is empty"),
        (lambda f: _replace_with_folder(f / "model.safetensors"), "model.safetensors", r"is a folder, not a file"),
        (lambda f: (f / "config.json").write_text("{model_type"), "config.json", r"is not valid JSON"),
        (lambda f: (f / "config.json").write_text('{"hidden_size": 8}'), "config.json", r"has no `model_type`"),
        (lambda f: (f / "config.json").write_text("[1]"), "config.json", r"holds a JSON list, not an object"),
        (lambda f: (f / "tokenizer.json").write_text("{"), "tokenizer.json", r"is not valid JSON"),
        (lambda f: _replace_with_folder(f / "config.json"), "config.json", r"is a folder, not a file"),
        (
            lambda f: (f / "model.safetensors").unlink(),
            "",
            r"has no model\.safetensors, .* or pytorch_model\.bin\.index\.json \(it holds config\.json",
        ),
    ],
    ids=[
        "truncated",
        "shorter-than-header",
        "empty",
        "folder",
        "config-json",
        "no-model-type",
        "config-list",
        "tokenizer-json",
        "config-folder",
        "no-weights",
    ],
)
def test_a_broken_checkpoint_is_named_with_its_file(checkpoint, breaking, file, match):
    breaking(checkpoint)
    with pytest.raises(InputFileError, match=match) as caught:
        check_checkpoint(checkpoint, "experts[1]")
    assert caught.value.argument == "experts[1]"
    assert caught.value.path == str(checkpoint / file if file else checkpoint)
    assert str(caught.value).startswith(f"`experts[1]` {caught.value.path!r}: ")
    with pytest.raises(InputFileError, match=match):  # the expert path of ComposedLM, analysis and lm-eval
        check_model_or_adapter(checkpoint, "experts[1]")


def _replace_with_folder(path):
    path.unlink()
    path.mkdir()


@pytest.mark.skipif(ROOT, reason="root reads a file whatever its mode")
def test_an_unreadable_config_is_named(checkpoint):
    (checkpoint / "config.json").chmod(0)
    try:
        with pytest.raises(InputFileError, match=r"config\.json': cannot be read \(permission denied\)"):
            check_checkpoint(checkpoint, "base")
    finally:
        (checkpoint / "config.json").chmod(0o644)


def _shard(checkpoint):
    """`checkpoint` rewritten as two safetensors shards and model.safetensors.index.json."""
    tensors = load_file(checkpoint / "model.safetensors")
    (checkpoint / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in halves.items():
        save_file({key: tensors[key] for key in keys}, checkpoint / shard)
    weight_map = {key: shard for shard, keys in halves.items() for key in keys}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def test_a_sharded_checkpoint_passes_and_a_missing_or_short_shard_is_named(checkpoint):
    weight_map = _shard(checkpoint)
    assert check_checkpoint(checkpoint, "base") == str(checkpoint)
    index = checkpoint / "model.safetensors.index.json"
    other = {**weight_map, "model.extra.weight": "model-00001-of-00002.safetensors"}
    index.write_text(json.dumps({"weight_map": other}))
    with pytest.raises(InputFileError, match=r"lacks 1 tensors that model\.safetensors\.index\.json maps.*extra"):
        check_checkpoint(checkpoint, "base")
    index.write_text(json.dumps({"weight_map": {**weight_map, "x": "../elsewhere.safetensors"}}))
    with pytest.raises(InputFileError, match=r"maps 'x' to '\.\./elsewhere\.safetensors', not a file name"):
        check_checkpoint(checkpoint, "base")
    index.write_text(json.dumps({"weight_map": weight_map}))
    (checkpoint / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(InputFileError, match=r"model-00002-of-00002\.safetensors': is missing: .* maps \d+ tensors"):
        check_checkpoint(checkpoint, "base")


def test_a_torch_bin_checkpoint_is_checked_without_unpickling(checkpoint, base_model):
    (checkpoint / "model.safetensors").unlink()
    weights = checkpoint / "pytorch_model.bin"
    torch.save(base_model.state_dict(), weights)
    assert check_checkpoint(checkpoint, "base") == str(checkpoint)
    _truncate(weights, weights.stat().st_size // 2)  # the central directory is at the end
    with pytest.raises(InputFileError, match=r"pytorch_model\.bin': is not a readable zip archive"):
        check_checkpoint(checkpoint, "base")
    with zipfile.ZipFile(weights, "w") as archive:
        archive.writestr("notes.txt", "not a torch file")
    with pytest.raises(InputFileError, match=r"without data\.pkl"):
        check_checkpoint(checkpoint, "base")


def test_safetensors_problem_keeps_its_old_home_and_message(checkpoint):
    path = checkpoint / "model.safetensors"
    assert safetensors_problem(path) is None and check_safetensors_file(str(path), "weights") == path
    _truncate(path, -1)
    assert safetensors_problem(path).startswith(f"{path} has ")


# ---- adapters, tokenizers, plain files ---------------------------------------------------------


@pytest.fixture
def adapter(lora_dirs, tmp_path):
    return shutil.copytree(lora_dirs["ab"], tmp_path / "ab")


def test_a_good_adapter_passes_and_broken_ones_are_named(adapter):
    assert check_adapter(adapter, "adapter") == str(adapter)
    assert check_model_or_adapter(str(adapter), "experts[0]") == "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "peft_type"}))
    with pytest.raises(InputFileError, match=r"adapter_config\.json': has no `peft_type`"):
        check_adapter(adapter, "adapter")
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(InputFileError, match=r"`adapters\['ab'\]` '.*adapter_model\.safetensors': is empty"):
        check_adapter(adapter, "adapters['ab']")
    (adapter / "adapter_model.safetensors").unlink()
    with pytest.raises(
        InputFileError,
        match=r"has no adapter_model\.safetensors or adapter_model\.bin \(it holds .*adapter_config\.json",
    ):
        check_model_or_adapter(adapter, "experts[0]")


def test_a_tokenizer_folder_needs_a_tokenizer_file_that_parses(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(InputFileError, match=r"has no tokenizer \(it holds config\.json\)"):
        check_tokenizer(tmp_path, "tokenizer")
    (tmp_path / "tokenizer_config.json").write_text('{"model_max_length": 8}')
    assert check_tokenizer(tmp_path, "tokenizer") == str(tmp_path)
    (tmp_path / "special_tokens_map.json").write_text("{,}")
    with pytest.raises(InputFileError, match=r"special_tokens_map\.json': is not valid JSON"):
        check_tokenizer(tmp_path, "tokenizer")


def test_text_and_json_files(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    with pytest.raises(InputFileError, match=r"is not UTF-8 text: byte b'\\xff' on line 2"):
        check_text_file(path, "data")
    path.write_text('{"text": "a"}\n')
    assert check_text_file(str(path), "data") == path
    assert check_json_file(path, "rule") == {"text": "a"}
    with pytest.raises(ValueError, match=r"`data` must be a path to a readable UTF-8 text file.*got None"):
        check_text_file(None, "data")


def test_a_command_opens_a_file_once_and_sees_a_rewrite(tmp_path, monkeypatch):
    """Inside `one_read_per_file` (each command), `read_utf8` opens a file once; a file rewritten since is read
    again; outside it, every call reads."""
    path = tmp_path / "config.yaml"
    path.write_text("a: 1\n")
    opened = []
    real = io.open

    def counting(file, *args, **kwargs):
        mode = args[0] if args else kwargs.get("mode", "r")
        if isinstance(file, (str, os.PathLike)) and Path(file) == path and "r" in mode:  # reads, not the writes
            opened.append(file)
        return real(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", counting)
    with one_read_per_file():
        assert read_utf8(path) == read_utf8(str(path)) == "a: 1\n" and len(opened) == 1
        path.write_text("a: 22\n")
        assert read_utf8(path) == "a: 22\n" and len(opened) == 2
    assert read_utf8(path) == read_utf8(path) == "a: 22\n" and len(opened) == 4
