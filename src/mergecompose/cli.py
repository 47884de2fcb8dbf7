"""The `mergecompose` command line. Each package adds its own subcommands; this file gathers them and
reports their errors in one place (`main`)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import warnings

import yaml
from pydantic import ValidationError

from mergecompose.core.cli_common import check_output_location, command_settings
from mergecompose.core.io import validation_message

# Modules that define `add_commands(subparsers)`; each subcommand sets `func(args) -> int`.
_COMMAND_MODULES = [
    "mergecompose.composition.cli",
    "mergecompose.integrations.vllm.cli",
    "mergecompose.merging.cli",
    "mergecompose.analysis.cli",
    "mergecompose.experiments.cli",
]
# Commands of an optional extra: module -> (the package it needs, the command, the extra).
_OPTIONAL_COMMAND_MODULES = {"mergecompose.integrations.lm_eval.cli": ("lm_eval", "lm-eval", "lm-eval")}

# Errors caused by the user's input, reported in one line. pydantic's ValidationError is a ValueError.
# OSError covers FileExistsError, FileNotFoundError and NotADirectoryError, and the plain OSError of
# transformers' `from_pretrained` for a model folder that does not exist.
EXPECTED_ERRORS = (ValueError, OSError, yaml.YAMLError)

_DESCRIPTION = (
    "Merge experts in parameter space, compose them in probability space, and compare the two. "
    "An expected error (a bad path, value or config) is one line on stderr, `mergecompose COMMAND: error: ...`, "
    "and exit status 2; `mergecompose --debug COMMAND ...` shows its traceback instead."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mergecompose", description=_DESCRIPTION)
    parser.add_argument("--debug", action="store_true", help="on an error, show the traceback (give it before COMMAND)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in _COMMAND_MODULES:
        importlib.import_module(module_name).add_commands(subparsers)
    for module_name, (package, command, extra) in _OPTIONAL_COMMAND_MODULES.items():
        if importlib.util.find_spec(package) is not None:
            importlib.import_module(module_name).add_commands(subparsers)
        else:
            _add_missing_extra(subparsers, command, package, extra)
    return parser


def _add_missing_extra(subparsers, command: str, package: str, extra: str) -> None:
    def refuse(args) -> int:
        raise ValueError(f'`{command}` needs the {package} package: pip install "mergecompose[{extra}]"')

    parser = subparsers.add_parser(command, prefix_chars="\x00", add_help=False, help=f"(needs the [{extra}] extra)")
    parser.add_argument("arguments", nargs="*")
    parser.set_defaults(func=refuse)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_output_location(getattr(args, "out", None))
        with command_settings(getattr(args, "threads", None), getattr(args, "quiet", False)), warnings.catch_warnings():
            warnings.simplefilter("always", UserWarning)  # what was done about the input: every time, not once
            warnings.showwarning = _one_line_warning(args.command, warnings.showwarning)
            return int(args.func(args) or 0)
    except EXPECTED_ERRORS as error:
        if args.debug:
            raise
        print(f"mergecompose {args.command}: error: {error_message(error)}", file=sys.stderr)
        return 2


def _one_line_warning(command: str, show_other):
    """`warnings.showwarning` for a command: a UserWarning (what was done about the input) is one line,
    `mergecompose COMMAND: warning: …`, as errors are; other categories (libraries' deprecations) go
    to `show_other` as before."""

    def show(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, UserWarning):
            return show_other(message, category, filename, lineno, file, line)
        text = " ".join(str(message).split())
        print(f"mergecompose {command}: warning: {text}", file=file or sys.stderr)

    return show


def error_message(error: BaseException) -> str:
    """The error as one line. pydantic's errors become `field: message (got value)` joined with "; ";
    other multi-line messages (e.g. a config error that embeds pydantic's) have their lines joined
    with "; ", without pydantic's "For further information visit ..." links."""
    if isinstance(error, ValidationError):
        return f"{error.title}: {validation_message(error)}"
    text = ""
    for line in str(error).splitlines():
        line = line.strip()
        if not line or line.startswith("For further information visit"):
            continue
        text += line if not text else (" " if text.endswith(":") else "; ") + line
    return text or type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
