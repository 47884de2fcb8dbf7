"""What every `mergecompose` subcommand shares, defined once: the flags `--out`, `--overwrite`, `--quiet`,
`--threads` and `--check`, and the declaration of the files and folders a command reads and writes.

Each package's command module (`*_command.py`, `*_commands.py`) calls `add_common_flags` and `declare_paths` on
its subparsers;
`mergecompose.cli.main` then, before anything is written or loaded, checks each output against every
declared input (`check_declared_paths`), runs the command's pre-flight, and runs the command inside
`command_settings`, which applies `--threads` and `--quiet` and restores both after.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch
import yaml
from transformers.utils import logging as transformers_logging

from mergecompose.core.io import read_utf8, refuse_output_over_inputs

CHECK_HELP = (
    "validate everything this command needs (config, paths, outputs, extras, free disk) and stop before any "
    "work: nothing is loaded, trained or written"
)


def positive_int(text: str) -> int:
    """argparse `type=`: an integer >= 1 (argparse turns the ArgumentTypeError into a usage error, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def add_common_flags(
    parser: argparse.ArgumentParser,
    *,
    out: str | None = None,
    out_required: bool = False,
    overwrite: str = "replace an existing --out folder",
    threads: bool = True,
    default_threads: int | None = None,
    check: bool = False,
) -> None:
    """Add `--quiet`, and `--out DIR` with `--overwrite` (if `out`, the help of `--out`, is given),
    `--threads N` (if `threads`; `default_threads=None` leaves torch's own default) and `--check`
    (if `check`: the pre-flight alone, for commands that run for minutes)."""
    if check:
        parser.add_argument("--check", action="store_true", help=CHECK_HELP)
    if out is not None:
        parser.add_argument("--out", metavar="DIR", required=out_required, help=out)
        parser.add_argument("--overwrite", action="store_true", help=overwrite)
    parser.add_argument("--quiet", action="store_true", help="no progress bars and no status lines, only the results")
    if threads:
        default = "torch's default" if default_threads is None else str(default_threads)
        parser.add_argument(
            "--threads",
            type=positive_int,
            default=default_threads,
            metavar="N",
            help=f"torch intra-op threads, N >= 1 (default: {default})",
        )


def add_composition_arguments(parser: argparse.ArgumentParser, base_help: str) -> None:
    """`--base`, `--expert` (repeated), `--weights` and `--names`: a base and the experts composed with it."""
    parser.add_argument("--base", required=True, metavar="DIR", help=base_help)
    parser.add_argument(
        "--expert",
        required=True,
        action="append",
        metavar="DIR",
        dest="experts",
        help="an expert: a full checkpoint or a peft LoRA adapter of the base (repeat for each)",
    )
    parser.add_argument(
        "--weights", type=float, nargs="+", metavar="W", help="one weight per expert (default 1.0 each)"
    )
    parser.add_argument("--names", nargs="+", metavar="NAME", help="one name per expert (default: the folder names)")


@contextlib.contextmanager
def command_settings(threads: int | None, quiet: bool) -> Iterator[None]:
    """Set torch's intra-op threads (unless None) and, if `quiet`, hide transformers' progress bars;
    restore both on exit, so that a command run in-process (tests) leaves no global state behind."""
    previous_threads = torch.get_num_threads()
    bars_were_enabled = transformers_logging.is_progress_bar_enabled()
    if threads is not None:
        torch.set_num_threads(threads)
    if quiet:
        transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        torch.set_num_threads(previous_threads)
        if bars_were_enabled:
            transformers_logging.enable_progress_bar()


INTERRUPTED = (
    "interrupted (Ctrl-C); every output is written whole or not at all, so nothing half-written was left; run the "
    "command again to redo the work"
)


def interrupted_cells(args: argparse.Namespace) -> str:
    """What a command that keeps each finished cell in its run folder says when interrupted."""
    return (
        f"interrupted (Ctrl-C); every finished cell is kept in {args.out}, and the same command resumes from them "
        "(cells in flight were stopped)"
    )


def interrupted_run_folder(args: argparse.Namespace) -> str:
    """What a command that caches its trained models and finished steps in its run folder says when interrupted."""
    return (
        f"interrupted (Ctrl-C); what finished (trained checkpoints, finished steps) is kept in {args.out}, and the "
        "same command goes on from it"
    )


@contextlib.contextmanager
def interrupts_once() -> Iterator[None]:
    """Within: the first Ctrl-C (SIGINT) raises KeyboardInterrupt, so that the command unwinds, keeps what it
    finished and says so; from then on SIGINT has its default action, so a second Ctrl-C kills at once (an unwinding
    that hangs, e.g. on a cluster that does not answer, is never in the way). The previous handler is restored on
    exit. Outside the main thread (where no handler can be set) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)

    def first_interrupt(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, first_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def check_output_location(out: str | os.PathLike | None, flag: str = "--out") -> None:
    """Refuse, before any work, an output path that cannot be written: one that is an existing file or something
    other than a folder, or whose nearest existing parent is a file or a folder this user may not write into.

    The one rule for every command's outputs: missing folders above an output are created (by `core.io`'s atomic
    writers), where the nearest existing one may be written into."""
    if out is None:
        return
    path = Path(out).expanduser()
    if path.is_file():
        raise FileExistsError(f"`{flag}` {str(out)!r} is a file; give a folder")
    _refuse_special_file(path, out, flag)
    _check_writable_parent(path if path.is_dir() else path.parent, out, flag)


def check_output_file_location(out: str | os.PathLike, flag: str = "--out") -> None:
    """Refuse, before any work, an output file that cannot be written: a folder, a named pipe, a device or a socket,
    or a path whose nearest existing parent is a file or a folder this user may not write into (missing folders
    above it are created, as for `check_output_location`)."""
    path = Path(out).expanduser()
    if path.is_dir():
        raise IsADirectoryError(f"`{flag}` {str(out)!r} is a folder; give a file")
    _refuse_special_file(path, out, flag)
    _check_writable_parent(path.parent, out, flag)


def _refuse_special_file(path: Path, out: str | os.PathLike, flag: str) -> None:
    """Refuse an output path that exists as something other than a regular file or a folder (a named pipe, a device,
    a socket): an output is written beside it and renamed over it, which would replace it with a file."""
    if path.exists() and not path.is_file() and not path.is_dir():
        raise FileExistsError(
            f"`{flag}` {str(out)!r} is not a regular file (a named pipe, a device or a socket); give a file or folder "
            "path (missing folders above it are created)"
        )


def _check_writable_parent(parent: Path, out: str | os.PathLike, flag: str) -> None:
    """The nearest existing folder of `parent` (itself or an ancestor) is a folder this user may write into."""
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(f"`{flag}` {str(out)!r} cannot be created: {str(parent)!r} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"`{flag}` {str(out)!r} cannot be written: {str(parent)!r} is not writable by this user")


# ---- the files and folders a command reads and writes ----------------------------------------------

_CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True)
class PathDeclaration:
    """Which arguments of a command name what it reads and what it writes.

    `inputs`: arguments whose value (a path, or a list of paths) is read. `configs`: arguments naming a
    config file; the file is an input, and so is every existing file or folder a string in it names
    (relative to the config's folder or to the working directory). `outputs`: arguments naming a
    folder the command writes (replacing it with `--overwrite`). `output_files`: arguments naming a file the command
    writes (the command says whether an existing one is replaced). `caches`: folders the command both
    reads and writes by design (a shared checkpoints folder), so an output may hold them. `more`: a
    function of the parsed arguments giving further (inputs, outputs), for a command whose
    arguments are another program's (`lm-eval`). `through_more`: arguments whose values hold paths without
    being paths (`NAME=FILE`), which `more` gives. `not_paths`: arguments that take no path although
    their help speaks of files or folders (for the test that finds undeclared path arguments).
    """

    inputs: tuple[str, ...] = ()
    configs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ("out",)
    output_files: tuple[str, ...] = ()
    caches: tuple[str, ...] = ()
    more: Callable[[argparse.Namespace], tuple[list[str], list[tuple[str, str]]]] | None = None
    through_more: tuple[str, ...] = ()  # arguments whose paths `more` gives (NAME=FILE values)
    not_paths: tuple[str, ...] = ()  # arguments whose help speaks of files or folders but take no path

    def named(self) -> set[str]:
        return {*self.inputs, *self.configs, *self.outputs, *self.output_files, *self.caches, *self.through_more}


def declare_paths(parser: argparse.ArgumentParser, **declaration: object) -> None:
    """Record on `parser` which of its arguments are inputs, configs, outputs and caches (`PathDeclaration`)."""
    parser.set_defaults(declared_paths=PathDeclaration(**declaration))  # type: ignore[arg-type]


def declared_inputs(args: argparse.Namespace) -> list[str]:
    """Every local file and folder the command given by `args` reads: its path arguments, its config files and
    every existing path named in them."""
    declaration: PathDeclaration = getattr(args, "declared_paths", PathDeclaration())
    inputs = [value for name in declaration.inputs for value in _values(getattr(args, name, None))]
    for name in declaration.configs:
        for config in _values(getattr(args, name, None)):
            inputs.append(config)
            inputs.extend(paths_named_in(config))
    if declaration.more is not None:
        inputs.extend(declaration.more(args)[0])
    return inputs


def declared_outputs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(flag, path) of every output folder the command given by `args` writes (its own flags, or else its config's
    `out`; what `more` gives is another program's and is checked only against the inputs)."""
    declaration: PathDeclaration = getattr(args, "declared_paths", PathDeclaration())
    outputs = [
        (_flag(name), value)
        for name in declaration.outputs
        for value in _values(getattr(args, name, None))
        if name != "out_dir" or getattr(args, "out", None) is None
    ]
    if not outputs:  # a config's own `out`, when no flag gives one
        for name in declaration.configs:
            for config in _values(getattr(args, name, None)):
                outputs.extend(outputs_named_in(config))
    return outputs


def check_declared_paths(args: argparse.Namespace) -> None:
    """Refuse, before anything is written, an output that cannot be written or that is, holds or lies inside an
    input: writing there (and with `--overwrite`, replacing it) would delete or change the user's files."""
    inputs = declared_inputs(args)
    for flag, out in declared_outputs(args):
        check_output_location(out, flag)
        refuse_output_over_inputs(out, inputs, f"`{flag}`")
    declaration: PathDeclaration = getattr(args, "declared_paths", PathDeclaration())
    for name in declaration.output_files:
        for out in _values(getattr(args, name, None)):
            check_output_file_location(out, _flag(name))
            refuse_output_over_inputs(out, inputs, f"`{_flag(name)}`")
    if declaration.more is not None:  # another program's outputs: it checks their form itself
        for flag, out in declaration.more(args)[1]:
            refuse_output_over_inputs(out, inputs, f"`{flag}`")


def paths_named_in(config: str | os.PathLike, _seen: set[Path] | None = None) -> list[str]:
    """The existing local files and folders that string values of the YAML or JSON file `config` name, and, for a
    config it names in turn, those that one names.

    A value counts when it exists relative to the config's folder or to the working directory (both are
    kept: either may be what the user meant). The values of output keys (`OUTPUT_KEYS`) are outputs, not
    inputs (`outputs_named_in`). A file that does not parse names nothing here; its own validation reports it.
    """
    path = Path(config).expanduser()
    seen = set() if _seen is None else _seen
    if path.suffix.lower() not in _CONFIG_SUFFIXES or not path.is_file() or path.resolve() in seen:
        return []
    seen.add(path.resolve())
    named: list[str] = []
    for text in _strings(_parsed(path)):
        if not text or "\n" in text or len(text) > 4096:
            continue
        for candidate in (path.parent / Path(text).expanduser(), Path(text).expanduser()):
            try:
                if candidate.exists() and not _holds_the_working_folders(candidate, path):
                    named.append(str(candidate))
                    named.extend(paths_named_in(candidate, seen))
            except (OSError, ValueError):  # a name too long, or with a NUL
                continue
    return list(dict.fromkeys(named))


def _holds_the_working_folders(candidate: Path, config: Path) -> bool:
    """Whether `candidate` is the config's folder, the working directory or a folder above them: a value such as
    "/" or "." (a separator, an alphabet's character) names no input, and would forbid every output."""
    folder = candidate.resolve()
    return any(folder == place or folder in place.parents for place in (config.resolve().parent, Path.cwd()))


OUTPUT_KEYS = frozenset({"out", "out_dir", "output_path"})


def outputs_named_in(config: str | os.PathLike) -> list[tuple[str, str]]:
    """(what, path) of each top-level output key (`OUTPUT_KEYS`) that the config file `config` sets."""
    data = _parsed(Path(config).expanduser())
    if not isinstance(data, dict):
        return []
    return [(f"`{key}` of {config}", value) for key, value in data.items() if key in OUTPUT_KEYS and _is_text(value)]


def _parsed(path: Path) -> object:
    try:
        return yaml.safe_load(read_utf8(path)) if path.is_file() else None
    except (OSError, ValueError, yaml.YAMLError):  # ValueError: the boundary's InputFileError, not UTF-8
        return None


def _is_text(value: object) -> bool:
    return isinstance(value, str) and bool(value)


def _strings(data: object) -> Iterator[str]:
    if isinstance(data, str):
        yield data
    elif isinstance(data, dict):
        for key, value in data.items():
            if key not in OUTPUT_KEYS:
                yield from _strings(key)
                yield from _strings(value)
    elif isinstance(data, (list, tuple)):
        for value in data:
            yield from _strings(value)


def _values(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [os.fspath(value)]
    if isinstance(value, Iterable):
        return [os.fspath(item) for item in value if isinstance(item, (str, os.PathLike))]
    return []


def _flag(dest: str) -> str:
    return "--out" if dest == "out_dir" else "--" + dest.replace("_", "-")


def check_free_disk(folder: str | os.PathLike, needed_bytes: int, what: str, flag: str = "--out") -> None:
    """Refuse, before the work, an output folder on a disk with less free space than `needed_bytes` (an estimate of
    what the command will write: `what`)."""
    path = Path(folder).expanduser()
    while not path.exists() and path != path.parent:
        path = path.parent
    free = shutil.disk_usage(path).free
    if needed_bytes > free:
        raise OSError(
            f"`{flag}` {str(folder)!r}: {what} need about {_size(needed_bytes)}, and its disk has {_size(free)} free; "
            "free some space or choose a folder on another disk"
        )


def _size(count: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"
