"""Files at the edge, shared by every package: atomic writes, markdown tables, YAML configs.

Everything a run writes goes through here, so that a crash halfway never leaves a half-written
file or folder under its final name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

ModelT = TypeVar("ModelT", bound=BaseModel)


def refuse_existing(out_dir: str | os.PathLike, overwrite: bool) -> Path:
    """Return `out_dir` as a Path; raise if it exists and `overwrite` is False."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(
            f"`out_dir` {str(out_dir)!r} already exists; pass overwrite=True (--overwrite on the command line) to replace it"
        )
    return out_dir


def refuse_output_over_inputs(out_dir: str | os.PathLike, inputs: Iterable[str | os.PathLike | None], what: str = "`out_dir`") -> None:
    """Refuse an output folder that is, contains, or lies inside a local input.

    Writing there (and with overwrite, replacing the folder) would delete or change the input.
    Inputs that are not local paths (hub ids, None, model objects) are skipped.
    """
    out = Path(out_dir).expanduser().resolve()
    for source in inputs:
        if not isinstance(source, (str, os.PathLike)) or not Path(source).expanduser().exists():
            continue
        local = Path(source).expanduser().resolve()
        if out == local or out in local.parents or local in out.parents:
            raise ValueError(
                f"{what} {str(out_dir)!r} is, contains or lies inside the input {str(source)!r}; writing there would "
                "delete or change that input (with overwrite, replace it): choose a folder outside every input"
            )


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder next to `out_dir`; on success rename it to `out_dir`.

    On an exception the temporary folder is removed and `out_dir` is left as it was (absent, or
    the old folder when overwriting). An existing `out_dir` is refused unless `overwrite=True`.
    """
    out_dir = refuse_existing(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    temporary = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    temporary.mkdir()
    try:
        yield temporary
        refuse_existing(out_dir, overwrite)  # something may have appeared meanwhile
        if out_dir.exists():
            trash = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(out_dir, trash)
            os.replace(temporary, out_dir)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(temporary, out_dir)
    finally:
        if temporary.exists():
            shutil.rmtree(temporary, ignore_errors=True)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None], suffix: str = "") -> None:
    """Call `write(temporary_path)` on a temporary file beside `path`, then rename it over `path`.

    `suffix` keeps the file type visible to writers that look at it (matplotlib's `savefig`).
    """
    path = Path(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(handle)
    try:
        write(Path(temporary))
        os.chmod(temporary, 0o666 & ~_umask())  # mkstemp makes it 0600: give it the mode a plain open() would
        os.replace(temporary, path)
    finally:
        Path(temporary).unlink(missing_ok=True)


def _umask() -> int:
    """The process's file-mode creation mask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` atomically (a temporary file beside it, then a rename)."""
    atomic_write(path, lambda temporary: temporary.write_text(text))


def atomic_save_figure(figure, path: str | os.PathLike, dpi: int = 120, **savefig_options) -> None:
    """Save a matplotlib figure to `path` atomically, with the file type taken from its suffix."""
    path = Path(path)
    atomic_write(path, lambda temporary: figure.savefig(temporary, dpi=dpi, **savefig_options), suffix=path.suffix)


def markdown_table(header: Sequence, rows: Sequence[Sequence], cell: Callable[[object], str] = str, pad: bool = False) -> str:
    """A markdown table; `cell` formats each body cell, `pad` aligns the columns for a terminal."""
    body = [[cell(value) for value in row] for row in rows]
    head = [str(name) for name in header]
    if not pad:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]

    def line(cells):
        return "| " + " | ".join(value.ljust(width) for value, width in zip(cells, widths)) + " |"

    return "\n".join([line(head), "|" + "|".join("-" * (width + 2) for width in widths) + "|", *map(line, body)])


def read_utf8(path: str | os.PathLike, what: str = "file") -> str:
    """The text of `path`; a byte that is not UTF-8 is reported with the file, the line and the byte."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ValueError(
            f"{what} {str(path)!r} is not UTF-8 text: byte {data[error.start:error.start + 1]!r} on line {line} "
            f"({error.reason}); save it as UTF-8"
        ) from None


def read_yaml_mapping(path: str | os.PathLike, what: str = "config") -> dict:
    """The mapping in the YAML file `path` (`yaml.safe_load`); errors name `what`, the file and what was found."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(read_utf8(path, f"{what} file"))
    except yaml.YAMLError as error:
        raise ValueError(f"{what} file {str(path)!r} is not valid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level of the {what} must be a mapping of settings, got {type(data).__name__}")
    return data


def validation_message(error: ValidationError) -> str:
    """A pydantic error as one line: `field.path: message (got value)` per problem, joined by '; '.

    Our own validators' messages already name the value received, and a missing field's input is
    the whole mapping, so neither gets `(got …)`; nor does a value too long to read in one line.
    """
    problems = []
    for problem in error.errors():
        where = ".".join(map(str, problem["loc"]))
        message = f"{where}: {problem['msg']}" if where else problem["msg"]
        received = repr(problem.get("input"))
        if where and problem["type"] not in ("value_error", "missing") and len(received) <= 80:
            message += f" (got {received})"
        problems.append(message)
    return "; ".join(problems)


def load_yaml_config(path: str | os.PathLike, model: type[ModelT], what: str = "config") -> ModelT:
    """Read `path` with `read_yaml_mapping` and validate it as `model`; the error names the file and each field."""
    data = read_yaml_mapping(path, what)
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise ValueError(f"{path}: invalid {what}: {validation_message(error)}") from None
