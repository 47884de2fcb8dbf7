"""The one loading boundary: every file read from the user's disk is checked here before any work starts.

Each `check_*` function takes the value the user gave and the name of the argument it came in, and
either returns it (as a string or a Path) or raises `InputFileError`, whose message names the
argument, the file, what is wrong with it and what was expected. The checks are cheap: headers,
sizes and JSON are read; weights are never loaded and pickles never unpickled.

* a checkpoint (`check_checkpoint`): config.json with a `model_type`; weights as model.safetensors,
  a sharded model.safetensors.index.json, or pytorch_model.bin (and its index), each checked;
  the tokenizer's JSON files that are present;
* an adapter (`check_adapter`): adapter_config.json with a `peft_type`; adapter_model.safetensors
  or adapter_model.bin;
* a tokenizer folder (`check_tokenizer`), a safetensors file, a JSON file, a text file, a GGUF file.

Hub ids are told from local paths by `mergecompose.core.sources`, which also checks that a hub id
can be reached; a hub id's files are checked by the library that downloads them.
"""

from __future__ import annotations

import codecs
import json
import math
import os
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from mergecompose.core import sources

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
# magic (4 bytes), version (uint32), tensor count (uint64), metadata count (uint64); little-endian.
_GGUF_HEADER = struct.Struct("<4sIQQ")
# The least a GGUF tensor info takes (name length uint64, n_dims uint32, type uint32, offset uint64)
# and the least a metadata entry takes (key length uint64, value type uint32).
_GGUF_MIN_TENSOR_INFO = 24
_GGUF_MIN_METADATA = 12
# Metadata value types of fixed size -> their struct format (8 is a string, 9 an array).
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_ALIGNMENT = 32  # when `general.alignment` is not given
# ggml tensor types -> (elements per block, bytes per block), as gguf's GGML_QUANT_SIZES gives them.
_GGML_BLOCKS = {
    **dict.fromkeys((0, 26), (1, 4)),  # F32, I32
    **dict.fromkeys((1, 25, 30), (1, 2)),  # F16, I16, BF16
    **dict.fromkeys((27, 28), (1, 8)),  # I64, F64
    24: (1, 1),  # I8
    **{2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40), 20: (32, 18), 39: (32, 17)},
    **{10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292)},
    **{16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 21: (256, 110), 22: (256, 82), 23: (256, 136)},
    **{29: (256, 56), 34: (256, 54), 35: (256, 66), 40: (64, 36), 41: (128, 18)},
}

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
ADAPTER_SAFETENSORS = "adapter_model.safetensors"
ADAPTER_BIN = "adapter_model.bin"
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# What AutoTokenizer can build a tokenizer from (a fast tokenizer's JSON, or a slow tokenizer's vocabulary).
TOKENIZER_FILES = (*TOKENIZER_JSON_FILES[:2], "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
_SAFETENSORS_EXPECTED = "a complete safetensors file (an 8-byte header length, a JSON header, the data it describes)"
_FileCheck = Callable[[Path, str], object]  # (file, argument): raises InputFileError
_TORCH_EXPECTED = "a torch.save zip archive (torch 1.6 or later) whose central directory opens"


class InputFileError(ValueError):
    """A file given by the user cannot be used: names the argument, the file, the problem and what is expected."""

    def __init__(self, argument: str, path: str | os.PathLike[str], problem: str, expected: str = "") -> None:
        self.argument = argument
        self.path = os.fspath(path)
        self.problem = problem
        self.expected = expected
        message = f"`{argument}` {self.path!r}: {problem}"
        super().__init__(f"{message}; expected {expected}" if expected else message)


def check_checkpoint(
    source: str | os.PathLike[str],
    argument: str,
    adapter_hint: str = "pass it as an adapter (an expert adapter) on its base",
) -> str:
    """`source` as a string, after checking that it is a full checkpoint (a checked local folder, or a hub id).

    A local folder needs config.json (a JSON object with `model_type`) and weights: model.safetensors,
    a sharded model.safetensors.index.json, pytorch_model.bin or its sharded index, in the order
    transformers prefers them; each is checked (`check_safetensors_file`, a torch zip archive). The
    tokenizer's JSON files that are present must parse. A hub id goes through
    `mergecompose.core.sources`; a peft adapter folder is refused with `adapter_hint`.
    """
    _check_config_files(source, argument)
    text = sources.check_model_source(source, argument, adapter_hint=adapter_hint)
    if sources.is_local(text):
        _check_checkpoint_folder(Path(text).expanduser(), argument)
    return text


def check_adapter(source: str | os.PathLike[str], argument: str) -> str:
    """`source` as a string, after checking that it is a peft adapter (a checked local folder, or a hub id).

    A local folder needs adapter_config.json (a JSON object with `peft_type`) and
    adapter_model.safetensors or adapter_model.bin, checked as in `check_checkpoint`.
    """
    _check_config_files(source, argument)
    text = sources.check_adapter_source(source, argument)
    if sources.is_local(text):
        _check_adapter_folder(Path(text).expanduser(), argument)
    return text


def check_model_or_adapter(source: str | os.PathLike[str], argument: str) -> Literal["checkpoint", "adapter"]:
    """Whether `source` is a full checkpoint or a peft adapter (`sources.source_kind`), after checking its files."""
    _check_config_files(source, argument)
    kind = sources.source_kind(source, argument)
    text = os.fspath(source)
    if sources.is_local(text):
        folder = Path(text).expanduser()
        _check_adapter_folder(folder, argument) if kind == "adapter" else _check_checkpoint_folder(folder, argument)
    return kind


def check_tokenizer(source: str | os.PathLike[str], argument: str) -> str:
    """`source` as a string, after checking that it is a tokenizer: a local folder or a hub id.

    A local folder needs one of `TOKENIZER_FILES`; the JSON ones that are present must parse.
    """
    text = sources.check_tokenizer_source(source, argument)
    if sources.is_local(text):
        folder = Path(text).expanduser()
        if not any((folder / name).exists() for name in TOKENIZER_FILES):
            raise InputFileError(
                argument,
                text,
                f"has no tokenizer ({sources.folder_contents(folder)})",
                f"a folder with {' or '.join(TOKENIZER_FILES)}",
            )
        _check_tokenizer_files(folder, argument)
    return text


def check_safetensors_file(path: str | os.PathLike[str], argument: str) -> Path:
    """`path` as a Path, after checking that its header parses and its size is exactly what the header declares."""
    check_safetensors_header(path, argument)
    return Path(os.fspath(path)).expanduser()


def check_safetensors_header(path: str | os.PathLike[str], argument: str) -> dict[str, Any]:
    """The header of the safetensors file `path` (tensor name -> dtype, shape, data_offsets), after checking the file.

    Raises InputFileError for an unreadable, empty or truncated file, or a header that does not parse.
    """
    file = _readable_file(path, argument, _SAFETENSORS_EXPECTED)
    header, problem = _safetensors_header(file)
    if problem is not None:
        raise InputFileError(argument, file, problem, _SAFETENSORS_EXPECTED)
    return header


def safetensors_problem(path: str | os.PathLike[str]) -> str | None:
    """What is wrong with the size of the safetensors file `path` against its own header (a truncated one), or None.

    The message starts with the path. `check_safetensors_file` is the same check raising InputFileError.
    """
    _, problem = _safetensors_header(Path(path))
    return None if problem is None else f"{path} {problem}"


def check_json_file(path: str | os.PathLike[str], argument: str) -> dict[str, Any]:
    """The JSON object in the file `path`, after checking that it is a readable UTF-8 file holding one."""
    expected = "a UTF-8 file holding one JSON object"
    file = check_text_file(path, argument)
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise InputFileError(
            argument, file, f"is not valid JSON ({error.msg} at line {error.lineno})", expected
        ) from None
    if not isinstance(value, dict):
        raise InputFileError(argument, file, f"holds a JSON {type(value).__name__}, not an object", expected)
    return value


_TEXT_FILE = "a readable UTF-8 text file"


def check_text_file(path: str | os.PathLike[str], argument: str) -> Path:
    """`path` as a Path, after checking that it is a readable, non-empty regular file of UTF-8 text."""
    file = _readable_file(path, argument, _TEXT_FILE)
    decoder = codecs.getincrementaldecoder("utf-8")()
    lines = 1
    with open(file, "rb") as handle:
        while True:
            chunk = handle.read(1 << 20)  # in pieces: a data file may be large
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as error:
                raise _not_utf8(argument, file, chunk, error, lines) from None
            if not chunk:
                return file
            lines += chunk.count(b"\n")


def read_text_file(path: str | os.PathLike[str], argument: str) -> str:
    """The text of `path`, opened once (a config is read once), with `check_text_file`'s checks and errors; a leading
    byte-order mark is dropped."""
    file = _regular_file(path, argument, _TEXT_FILE)
    try:
        data = file.read_bytes()
    except OSError as error:
        raise _unreadable(error, argument, file, _TEXT_FILE) from None
    if not data:
        raise InputFileError(argument, file, "is empty", _TEXT_FILE)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _not_utf8(argument, file, data, error, 1) from None
    return text.removeprefix("\ufeff")  # a byte-order mark (editors on Windows write one) is not text


def _not_utf8(argument: str, file: Path, data: bytes, error: UnicodeDecodeError, lines: int) -> InputFileError:
    """The error for a byte that is not UTF-8: its line (`lines` counted before `data`) and the byte."""
    line = lines + data.count(b"\n", 0, max(error.start, 0))
    problem = f"is not UTF-8 text: byte {data[error.start : error.start + 1]!r} on line {line}"
    return InputFileError(argument, file, problem, _TEXT_FILE)


def check_gguf_file(path: str | os.PathLike[str], argument: str) -> Path:
    """`path` as a Path, after checking that it is a complete GGUF file this code can read.

    Reads the little-endian header only: the magic `GGUF`, a version in `GGUF_VERSIONS`, the tensor
    count and the metadata count (each an uint64), every metadata entry and tensor info, and checks
    that each tensor's data (offset and size from its type and shape) lies within the file.
    """
    expected = f"a GGUF file (magic {GGUF_MAGIC!r}, version {' or '.join(map(str, GGUF_VERSIONS))})"
    file = _readable_file(path, argument, expected)
    with open(file, "rb") as handle:
        head = handle.read(_GGUF_HEADER.size)
    if head[:4] != GGUF_MAGIC:
        raise InputFileError(argument, file, f"is not a GGUF file: it starts with {head[:4]!r}", expected)
    if len(head) < _GGUF_HEADER.size:
        raise InputFileError(argument, file, f"is truncated: {len(head)} bytes, shorter than a GGUF header", expected)
    _, version, tensors, metadata = _GGUF_HEADER.unpack(head)
    if version not in GGUF_VERSIONS:
        raise InputFileError(argument, file, f"has GGUF version {version}, which this code cannot read", expected)
    size = file.stat().st_size
    least = _GGUF_HEADER.size + tensors * _GGUF_MIN_TENSOR_INFO + metadata * _GGUF_MIN_METADATA
    if least > size:
        raise InputFileError(
            argument,
            file,
            f"is truncated: its header declares {tensors} tensors and {metadata} metadata entries, "
            f"which cannot fit in its {size} bytes",
            expected,
        )
    with open(file, "rb") as handle:
        handle.seek(_GGUF_HEADER.size)
        try:
            end = _GGUFReader(handle, size).data_end(tensors, metadata)
        except _GGUFShort:
            raise InputFileError(
                argument, file, f"is truncated: its header runs past its {size} bytes", expected
            ) from None
        except ValueError as error:
            raise InputFileError(argument, file, f"has an unreadable GGUF header ({error})", expected) from None
    if end > size:
        raise InputFileError(
            argument, file, f"is truncated: {size} bytes, its tensors' data runs to byte {end}", expected
        )
    return file


class _GGUFShort(Exception):
    """The GGUF header asks for bytes past the end of the file."""


class _GGUFReader:
    """Walks a GGUF header (metadata entries, then tensor infos) without reading any tensor data."""

    def __init__(self, handle: Any, size: int) -> None:
        self.handle, self.size = handle, size

    def read(self, count: int) -> bytes:
        if self.handle.tell() + count > self.size:
            raise _GGUFShort
        return bytes(self.handle.read(count))

    def unpack(self, form: str) -> Any:
        layout = struct.Struct("<" + form)
        return layout.unpack(self.read(layout.size))[0]

    def string(self) -> bytes:
        return self.read(self.unpack("Q"))

    def value(self, kind: int) -> Any:
        if kind in _GGUF_SCALARS:
            return self.unpack(_GGUF_SCALARS[kind])
        if kind == _GGUF_STRING:
            return self.string()
        if kind != _GGUF_ARRAY:
            raise ValueError(f"metadata value type {kind}")
        item, count = self.unpack("I"), self.unpack("Q")
        if item in _GGUF_SCALARS:  # skipped, not read: a vocabulary's scores may be large
            width = struct.calcsize("<" + _GGUF_SCALARS[item])
            if self.handle.tell() + count * width > self.size:
                raise _GGUFShort
            self.handle.seek(count * width, os.SEEK_CUR)
            return None
        for _ in range(count):
            self.value(item)
        return None

    def data_end(self, tensors: int, metadata: int) -> int:
        """The byte at which the last tensor's data ends (for tensor types it knows)."""
        alignment = _GGUF_ALIGNMENT
        for _ in range(metadata):
            key, value = self.string(), self.value(self.unpack("I"))
            if key == b"general.alignment" and isinstance(value, int) and value > 0:
                alignment = value
        infos = []
        for _ in range(tensors):
            self.string()
            shape = [self.unpack("Q") for _ in range(self.unpack("I"))]
            infos.append((shape, self.unpack("I"), self.unpack("Q")))
        start = -(-self.handle.tell() // alignment) * alignment  # the data section starts aligned
        end = start
        for shape, kind, offset in infos:
            elements, (block, width) = math.prod(shape), _GGML_BLOCKS.get(kind, (1, 0))
            end = max(end, start + offset + -(-elements // block) * width)
        return end


# ---- files -------------------------------------------------------------------------------------


def _regular_file(path: object, argument: str, expected: str) -> Path:
    """`path` as a Path: an existing regular file (nothing opened)."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"`{argument}` must be a path to {expected} (a non-empty string), got {path!r}")
    file = Path(os.fspath(path)).expanduser()
    if not file.exists():
        raise InputFileError(argument, file, "does not exist", expected)
    if file.is_dir():
        raise InputFileError(argument, file, "is a folder, not a file", expected)
    if not file.is_file():
        raise InputFileError(argument, file, "is not a regular file", expected)
    return file


def _unreadable(error: OSError, argument: str, file: Path, expected: str) -> InputFileError:
    if isinstance(error, PermissionError):
        return InputFileError(argument, file, "cannot be read (permission denied)", expected)
    return InputFileError(argument, file, f"cannot be read ({error.strerror or error})", expected)


def _readable_file(path: object, argument: str, expected: str) -> Path:
    """`path` as a Path: an existing, non-empty regular file this user can open."""
    file = _regular_file(path, argument, expected)
    try:
        with open(file, "rb"):
            pass
    except OSError as error:
        raise _unreadable(error, argument, file, expected) from None
    if file.stat().st_size == 0:
        raise InputFileError(argument, file, "is empty", expected)
    return file


# ---- folders -----------------------------------------------------------------------------------


def _check_checkpoint_folder(folder: Path, argument: str) -> None:
    weights: dict[str, _FileCheck] = {
        SAFETENSORS: check_safetensors_file,
        SAFETENSORS_INDEX: check_sharded_index,
        TORCH_BIN: _check_torch_archive,
        TORCH_BIN_INDEX: check_sharded_index,
    }
    _check_weights(folder, argument, weights, "a checkpoint")
    _check_config(folder / sources.CONFIG, "model_type", argument, "a transformers config.json")
    _check_tokenizer_files(folder, argument)


def _check_adapter_folder(folder: Path, argument: str) -> None:
    weights: dict[str, _FileCheck] = {ADAPTER_SAFETENSORS: check_safetensors_file, ADAPTER_BIN: _check_torch_archive}
    _check_weights(folder, argument, weights, "a peft adapter folder")
    _check_config(folder / sources.ADAPTER_CONFIG, "peft_type", argument, "a peft adapter_config.json")


def _check_config(file: Path, key: str, argument: str, what: str) -> None:
    """`file` is a JSON object with a non-empty string `key` (config.json's `model_type`, peft's `peft_type`)."""
    config = check_json_file(file, argument)
    if not isinstance(config.get(key), str) or not config[key]:
        keys = ", ".join(sorted(config)[:8]) or "none"
        raise InputFileError(argument, file, f"has no `{key}` (keys: {keys})", f"{what} with `{key}`")


def _check_weights(folder: Path, argument: str, checks: dict[str, _FileCheck], what: str) -> None:
    """Check the first of `checks`' files that `folder` has (the order in which the library looks for them)."""
    present = next((name for name in checks if (folder / name).exists()), None)
    if present is None:
        names = [*checks]
        listed = f"{', '.join(names[:-1])} or {names[-1]}"
        problem = f"has no {listed} ({sources.folder_contents(folder)})"
        raise InputFileError(argument, folder, problem, f"{what} with its weights")
    checks[present](folder / present, argument)


def _check_config_files(source: object, argument: str) -> None:
    """config.json and adapter_config.json, where a local folder has them, are readable files.

    Checked before `sources` tells the kinds apart, which a folder in place of one would mislead.
    """
    if not isinstance(source, (str, os.PathLike)) or not os.fspath(source):
        return  # `sources` names what the value should be
    folder = Path(os.fspath(source)).expanduser()
    for name in (sources.CONFIG, sources.ADAPTER_CONFIG):
        if folder.is_dir() and (folder / name).exists():
            check_json_file(folder / name, argument)


def _check_tokenizer_files(folder: Path, argument: str) -> None:
    for name in TOKENIZER_JSON_FILES:
        if (folder / name).exists():
            check_json_file(folder / name, argument)


def check_sharded_index(index_path: Path, argument: str) -> None:
    """Check a sharded checkpoint's index (model.safetensors.index.json, pytorch_model.bin.index.json).

    Its `weight_map` names shard files beside it, each of which exists and checks out; for safetensors
    shards, every tensor the map assigns to a shard is in that shard's header.
    """
    expected = "an index whose `weight_map` maps each tensor name to a shard file beside it"
    index = check_json_file(index_path, argument)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise InputFileError(argument, index_path, "has no `weight_map` object", expected)
    shards: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or Path(shard).name != shard:
            raise InputFileError(argument, index_path, f"maps {tensor!r} to {shard!r}, not a file name", expected)
        shards.setdefault(shard, []).append(tensor)
    for shard, tensors in sorted(shards.items()):
        file = index_path.parent / shard
        if not file.exists():
            raise InputFileError(
                argument, file, f"is missing: {index_path.name} maps {len(tensors)} tensors to it", expected
            )
        if shard.endswith(".safetensors"):
            missing = sorted(set(tensors) - set(check_safetensors_header(file, argument)) - {"__metadata__"})
            if missing:
                raise InputFileError(
                    argument,
                    file,
                    f"lacks {len(missing)} tensors that {index_path.name} maps to it (first: {missing[0]!r})",
                    expected,
                )
        else:
            _check_torch_archive(file, argument)


def _check_torch_archive(path: Path, argument: str) -> None:
    """A `torch.save` file checked without unpickling: a zip archive whose central directory opens and whose
    entries lie within the file."""
    file = _readable_file(path, argument, _TORCH_EXPECTED)
    size = file.stat().st_size
    try:
        with zipfile.ZipFile(file) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as error:
        raise InputFileError(argument, file, f"is not a readable zip archive ({error})", _TORCH_EXPECTED) from None
    if not any(entry.filename.endswith("data.pkl") for entry in entries):
        raise InputFileError(
            argument, file, "is a zip archive without data.pkl, not a torch.save file", _TORCH_EXPECTED
        )
    beyond = next((entry for entry in entries if entry.header_offset + entry.compress_size > size), None)
    if beyond is not None:
        raise InputFileError(
            argument, file, f"is truncated: {beyond.filename} ends past its {size} bytes", _TORCH_EXPECTED
        )


def _safetensors_header(file: Path) -> tuple[dict[str, Any], str | None]:
    """The header of the safetensors file `file` and what is wrong with the file against it (None if nothing).

    The format: 8 bytes giving the header's length N (little-endian), N bytes of JSON giving each
    tensor's `data_offsets` into the data that follows, which must end where the file ends.
    Reads the header only.
    """
    size = file.stat().st_size
    with open(file, "rb") as handle:
        head = handle.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else size
        if 8 + length > size:
            return {}, f"is truncated: {size} bytes, shorter than its own header"
        try:
            header = json.loads(handle.read(length))
            ends = [_data_end(record) for key, record in header.items() if key != "__metadata__"]
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return {}, "has an unreadable safetensors header"
    declared = 8 + length + max(ends, default=0)
    if declared != size:
        return header, f"has {size} bytes, its header describes {declared} (truncated or changed)"
    return header, None


def _data_end(record: dict[str, Any]) -> int:
    begin, end = (int(offset) for offset in record["data_offsets"])
    if not 0 <= begin <= end:
        raise ValueError(f"data_offsets {begin}, {end}")
    return end
