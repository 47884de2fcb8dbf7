"""Files at the edge, shared by every package: atomic writes, markdown tables, YAML configs.

Everything a run writes goes through here, so that a crash halfway never leaves a half-written
file or folder under its final name. The temporaries name their writer's pid, so that the next
write removes those a killed run left (`remove_leftovers`); a manifest of file sizes lets a cache
entry be checked before it is reused (`write_manifest`, `manifest_problem`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from mergecompose.core.boundary import (
    InputFileError,
    read_text_file,
    safetensors_problem,  # noqa: F401 - its old home; experiments import it
)
from mergecompose.core.locks import pid_running

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ModelT = TypeVar("ModelT", bound=BaseModel)

# The temporaries of an atomic write beside NAME: `.NAME.tmp-PID-HEX` (the new file or folder) and
# `.NAME.old-PID-HEX` (the folder it replaces), PID being the writer's. Versions before the pid was
# recorded wrote `.NAME.tmp-HEX`; such a leftover is named in a warning but left alone.
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?:(?P<pid>\d+)-)?[0-9a-f]{8}(?:\.\w+)?$")
MANIFEST_NAME = "manifest.json"


class LeftoverWarning(UserWarning):
    """A temporary file or folder of a killed run was found (and removed if its writer is gone)."""


def refuse_existing(out_dir: str | os.PathLike, overwrite: bool) -> Path:
    """Return `out_dir` as a Path; raise if it exists and `overwrite` is False."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(
            f"`out_dir` {str(out_dir)!r} already exists; pass overwrite=True (--overwrite on the command line) "
            "to replace it"
        )
    return out_dir


def refuse_output_over_inputs(
    out_dir: str | os.PathLike, inputs: Iterable[str | os.PathLike | None], what: str = "`out_dir`"
) -> None:
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
    A killed writer's temporary folder is removed by the next write of `out_dir` (`remove_leftovers`).
    """
    out_dir = refuse_existing(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out_dir.parent, out_dir.name)
    temporary = _temporary_path(out_dir, "tmp")
    temporary.mkdir()
    try:
        yield temporary
        refuse_existing(out_dir, overwrite)  # something may have appeared meanwhile
        if out_dir.exists():
            trash = _temporary_path(out_dir, "old")
            os.replace(out_dir, trash)
            os.replace(temporary, out_dir)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(temporary, out_dir)
    finally:
        if temporary.exists():
            shutil.rmtree(temporary, ignore_errors=True)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object], suffix: str = "") -> None:
    """Call `write(temporary_path)` on a temporary file beside `path`, then rename it over `path`.

    `suffix` keeps the file type visible to writers that look at it (matplotlib's `savefig`).
    A killed writer's temporary file is removed by the next write of `path` (`remove_leftovers`). Missing folders
    above `path` are created, as `atomic_output_dir` creates those above a folder.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path.parent, path.name)
    temporary = _temporary_path(path, "tmp", suffix)
    os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # the mode the user's umask allows
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _temporary_path(target: Path, kind: str, suffix: str = "") -> Path:
    """`.NAME.KIND-PID-HEX[suffix]` beside `target`: hidden, and traceable to its writer if that is killed."""
    return target.parent / f".{target.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}{suffix}"


def is_leftover_name(name: str) -> bool:
    """Whether `name` is that of an atomic write's temporary (`.NAME.tmp-PID-HEX`, `.NAME.old-PID-HEX`)."""
    return _LEFTOVER.match(name) is not None


def remove_leftovers(folder: str | os.PathLike, name: str | None = None) -> list[Path]:
    """Remove the temporaries of atomic writes in `folder` whose writer is no longer running; return them.

    `name`: only those of that file or folder. Each removal is a `LeftoverWarning` naming the path
    and the writer's pid. A temporary of a running writer is left alone; one of an older version
    (no pid in its name) is left too, but named in a warning so that it is found.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for path in sorted(folder.iterdir()):
        match = _LEFTOVER.match(path.name)
        if match is None or (name is not None and match["name"] != name):
            continue
        if match["pid"] is None:
            warnings.warn(
                f"{path} looks like the leftover of an interrupted run of an older version (its writer is "
                f"unknown); delete it once no run writes into {folder}",
                LeftoverWarning,
                stacklevel=2,
            )
        elif not pid_running(int(match["pid"])):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            warnings.warn(
                f"removed {path}, left by a killed run (pid {match['pid']}, no longer running)",
                LeftoverWarning,
                stacklevel=2,
            )
            removed.append(path)
    return removed


def write_manifest(folder: str | os.PathLike) -> None:
    """Write `folder/manifest.json`, the size in bytes of every other file in `folder`; call it last.

    Sizes, not hashes: they find what a killed run or a full disk leaves (a truncated or a missing
    file) with one `stat` per file, where a hash would read every byte of a checkpoint on each reuse.
    """
    folder = Path(folder)
    files = {
        str(path.relative_to(folder)): path.stat().st_size
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != MANIFEST_NAME
    }
    atomic_write_text(folder / MANIFEST_NAME, json.dumps({"files": files}, indent=1))


def manifest_problem(folder: str | os.PathLike) -> str | None:
    """What is wrong with `folder` against its `manifest.json`, in one line that names the file; None if nothing.

    Wrong: the manifest is missing or unreadable, or a file it lists is missing or of another size.
    """
    folder = Path(folder)
    manifest = folder / MANIFEST_NAME
    try:
        listed = {str(relative): int(size) for relative, size in json.loads(manifest.read_text())["files"].items()}
    except FileNotFoundError:
        return f"{manifest} is missing"
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"{manifest} is not a valid manifest"
    for relative, size in listed.items():
        path = folder / relative
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes, the manifest says {size} (truncated or changed)"
    return None


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` atomically (a temporary file beside it, then a rename)."""
    atomic_write(path, lambda temporary: temporary.write_text(text))


def atomic_save_figure(figure: Figure, path: str | os.PathLike, dpi: int = 120, **savefig_options: Any) -> None:
    """Save a matplotlib figure to `path` atomically, with the file type taken from its suffix."""
    path = Path(path)
    atomic_write(path, lambda temporary: figure.savefig(temporary, dpi=dpi, **savefig_options), suffix=path.suffix)


def markdown_table(
    header: Sequence, rows: Sequence[Sequence], cell: Callable[[object], str] = str, pad: bool = False
) -> str:
    """A markdown table; `cell` formats each body cell, `pad` aligns the columns for a terminal."""
    body = [[cell(value) for value in row] for row in rows]
    head = [str(name) for name in header]
    if not pad:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(value.ljust(width) for value, width in zip(cells, widths)) + " |"

    return "\n".join([line(head), "|" + "|".join("-" * (width + 2) for width in widths) + "|", *map(line, body)])


def read_utf8(path: str | os.PathLike, what: str = "file") -> str:
    """The text of `path`, read through the loading boundary (`read_text_file`): a readable, non-empty regular
    file of UTF-8 text; a byte that is not UTF-8 is reported with the file, the line and the byte. Inside
    `one_read_per_file`, a file already read is not opened again."""
    texts = _ONE_READ.get()
    if texts is None:
        return read_text_file(path, what)
    try:
        file = Path(path).expanduser().resolve()
        stat = file.stat()
    except (OSError, TypeError, ValueError):
        return read_text_file(path, what)  # the boundary names what is wrong
    key = (file, stat.st_mtime_ns, stat.st_size)  # a file rewritten since is read again
    if key not in texts:
        texts[key] = read_text_file(path, what)
    return texts[key]


def jsonl_values(text: str, argument: str, name: str | os.PathLike) -> list[tuple[int, Any]]:
    """(line number, value) of every non-blank line of a JSONL file's `text`; a line that is not JSON is a
    ValueError naming the argument, the file (`name`: it reads none) and the line."""
    values = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            values.append((number, json.loads(line)))
        except json.JSONDecodeError as error:
            raise ValueError(f"`{argument}` {str(name)!r} line {number} is not JSON: {error.msg}") from None
    return values


_ONE_READ: ContextVar[dict[tuple[Path, int, int], str] | None] = ContextVar("one_read_per_file", default=None)


@contextlib.contextmanager
def one_read_per_file() -> Iterator[None]:
    """Inside the block, each file read through `read_utf8` is opened once: a command's config is read once,
    though the command line's path check and the config's loading both parse it, and both see the same text."""
    token = _ONE_READ.set({})
    try:
        yield
    finally:
        _ONE_READ.reset(token)


def read_yaml_mapping(path: str | os.PathLike, what: str = "config") -> dict:
    """The mapping in the YAML file `path` (`yaml.safe_load`); an `InputFileError` names `what`, the file and what
    was found (a folder, nothing, an empty file, text that is not UTF-8 or not YAML, a list)."""
    expected = "a YAML file with a mapping of settings"
    argument = what.replace("`", "")
    try:
        data = yaml.safe_load(read_utf8(path, argument))
    except InputFileError as error:
        raise InputFileError(argument, path, error.problem, expected) from None
    except yaml.YAMLError as error:
        raise InputFileError(argument, path, f"is not valid YAML: {' '.join(str(error).split())}", expected) from None
    if not isinstance(data, dict):
        found = "nothing but comments" if data is None else f"a {type(data).__name__} at the top level"
        raise InputFileError(argument, path, f"holds {found}", expected)
    return data


def validation_message(error: ValidationError, tagged: bool = False) -> str:
    """A pydantic error as one line: `field.path: message (got value)` per problem, joined by '; '.

    Our own validators' messages already name the value received, and a missing field's input is
    the whole mapping, so neither gets `(got …)`; nor does a value too long to read in one line.
    `tagged`: the error of a tagged union, whose locations start with the member's tag; it is left out.
    """
    problems = []
    for problem in error.errors():
        where = ".".join(map(str, problem["loc"][1:] if tagged else problem["loc"]))
        message = f"{where}: {problem['msg']}" if where else problem["msg"]
        received = repr(problem.get("input"))
        if where and problem["type"] not in ("value_error", "missing") and len(received) <= 80:
            message += f" (got {received})"
        problems.append(message)
    return "; ".join(problems)


class StrictModel(BaseModel):
    """The base of every config model read from a file: an unknown field is an error, a validated config does not
    change, and every float is finite (`lr: .inf` or `alpha: .nan` is refused at load time, not after training)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def load_yaml_config(path: str | os.PathLike, model: type[ModelT], what: str = "config") -> ModelT:
    """Read `path` with `read_yaml_mapping` and validate it as `model`; the error names the file and each field.
    Validators find the file's folder as `info.context["config_dir"]` (to read relative paths from there)."""
    data = read_yaml_mapping(path, what)
    try:
        return model.model_validate(data, context={"config_dir": Path(path).parent})
    except ValidationError as error:
        raise ValueError(f"{path}: invalid {what}: {validation_message(error)}") from None
