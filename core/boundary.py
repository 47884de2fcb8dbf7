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

import os
import struct
from pathlib import Path

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
# magic (4 bytes), version (uint32), tensor count (uint64), metadata count (uint64); little-endian.
_GGUF_HEADER = struct.Struct("<4sIQQ")
# The least a GGUF tensor info takes (name length uint64, n_dims uint32, type uint32, offset uint64)
# and the least a metadata entry takes (key length uint64, value type uint32).
_GGUF_MIN_TENSOR_INFO = 24
_GGUF_MIN_METADATA = 12


class InputFileError(ValueError):
    """A file given by the user cannot be used: names the argument, the file, the problem and what is expected."""

    def __init__(self, argument: str, path: str | os.PathLike[str], problem: str, expected: str = "") -> None:
        self.argument = argument
        self.path = os.fspath(path)
        self.problem = problem
        self.expected = expected
        message = f"`{argument}` {self.path!r}: {problem}"
        super().__init__(f"{message}; expected {expected}" if expected else message)


def check_gguf_file(path: str | os.PathLike[str], argument: str) -> Path:
    """`path` as a Path, after checking that it is a GGUF file this code can read.

    Reads the little-endian header only: the magic `GGUF`, a version in `GGUF_VERSIONS`, the tensor
    count and the metadata count (each an uint64), which must fit in the file's size.
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
    return file


# ---- files -------------------------------------------------------------------------------------


def _readable_file(path: object, argument: str, expected: str) -> Path:
    """`path` as a Path: an existing, non-empty regular file this user can open."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"`{argument}` must be a path to {expected} (a non-empty string), got {path!r}")
    file = Path(os.fspath(path)).expanduser()
    if not file.exists():
        raise InputFileError(argument, file, "no such file", expected)
    if file.is_dir():
        raise InputFileError(argument, file, "is a folder, not a file", expected)
    if not file.is_file():
        raise InputFileError(argument, file, "is not a regular file", expected)
    try:
        with open(file, "rb"):
            pass
    except PermissionError:
        raise InputFileError(argument, file, "cannot be read (permission denied)", expected) from None
    except OSError as error:
        raise InputFileError(argument, file, f"cannot be read ({error.strerror or error})", expected) from None
    if file.stat().st_size == 0:
        raise InputFileError(argument, file, "is empty", expected)
    return file
