"""Flags every `mergecompose` subcommand shares, defined once: `--out`, `--overwrite`, `--quiet`, `--threads`.

Each package's `cli.py` calls `add_common_flags` on its subparsers; `mergecompose_cli.main` runs every
command inside `command_settings`, which applies `--threads` and `--quiet` and restores both after.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

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
            "--threads", type=positive_int, default=default_threads, metavar="N",
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
