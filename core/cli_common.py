"""Flags every `mergecompose` subcommand shares, defined once: `--out`, `--overwrite`, `--quiet`, `--threads`.

Each package's `cli.py` calls `add_common_flags` on its subparsers; `mergecompose.cli.main` runs every
command inside `command_settings`, which applies `--threads` and `--quiet` and restores both after.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers.utils import logging as transformers_logging


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
) -> None:
    """Add `--quiet`, and `--out DIR` with `--overwrite` (if `out`, the help of `--out`, is given),
    and `--threads N` (if `threads`; `default_threads=None` leaves torch's own default)."""
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


def check_output_location(out: str | os.PathLike | None, flag: str = "--out") -> None:
    """Refuse, before any work, an output path that cannot be written: one that is an existing file,
    or whose nearest existing parent is a file or a folder this user may not write into."""
    if out is None:
        return
    path = Path(out).expanduser()
    if path.is_file():
        raise FileExistsError(f"`{flag}` {str(out)!r} is a file; give a folder")
    parent = path if path.is_dir() else path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(f"`{flag}` {str(out)!r} cannot be created: {str(parent)!r} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"`{flag}` {str(out)!r} cannot be written: {str(parent)!r} is not writable by this user")
