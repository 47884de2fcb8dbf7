"""The loading boundary (`mergecompose.core.boundary`): each kind of bad file is refused naming the argument and
the file, before anything loads."""

from __future__ import annotations

import struct

import pytest

from mergecompose.core.boundary import InputFileError, check_gguf_file


def _gguf(path, magic=b"GGUF", version=3, tensors=0, metadata=0, extra=b""):
    path.write_bytes(struct.pack("<4sIQQ", magic, version, tensors, metadata) + extra)
    return path


def test_gguf_file_with_a_known_header_passes(tmp_path):
    path = _gguf(tmp_path / "model.gguf", version=2, tensors=1, metadata=1, extra=b"\0" * 36)
    assert check_gguf_file(str(path), "gguf") == path


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (lambda p: _gguf(p, magic=b"GGML"), r"`gguf` '.*model\.gguf': is not a GGUF file: it starts with b'GGML'"),
        (lambda p: _gguf(p, version=7), r"has GGUF version 7, which this code cannot read"),
        (lambda p: p.write_bytes(b"GGUF\3\0"), r"is truncated: 6 bytes, shorter than a GGUF header"),
        (lambda p: _gguf(p, tensors=2, metadata=1), r"declares 2 tensors and 1 metadata entries.* 24 bytes"),
        (lambda p: p.write_bytes(b""), r"is empty; expected a GGUF file"),
        (lambda p: p.mkdir(), r"is a folder, not a file"),
        (lambda p: None, r"no such file"),
    ],
    ids=["magic", "version", "short", "counts", "empty", "folder", "missing"],
)
def test_bad_gguf_files_are_named(tmp_path, content, match):
    path = tmp_path / "model.gguf"
    content(path)
    with pytest.raises(InputFileError, match=match) as caught:
        check_gguf_file(path, "gguf")
    assert caught.value.argument == "gguf" and caught.value.path == str(path)
