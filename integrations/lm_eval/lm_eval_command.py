"""`mergecompose lm-eval ARGS…`: lm-eval's own command line, with the `composed` model registered.

lm-eval has no plugin hook for models, so this command imports `mergecompose.integrations.lm_eval.harness_model` (which
registers `composed`) and then runs lm-eval's CLI on exactly the arguments given, in lm-eval's
spelling (`--model composed --model_args base=…,experts=…|… --tasks …`, `--confirm_run_unsafe_code`
for code tasks, `ls tasks`, …), plus our `--quiet`.
"""

from __future__ import annotations

import contextlib
import sys

from lm_eval._cli import HarnessCLI

import mergecompose.integrations.lm_eval.harness_model  # noqa: F401  (registers the `composed` model)
from mergecompose.core.cli_common import declare_paths
from mergecompose.integrations.lm_eval.quiet import quiet_lm_eval


def add_commands(subparsers) -> None:
    # No option of our own: a prefix character no argument starts with makes argparse hand every
    # argument (`--model`, `-h`, …) to lm-eval unchanged.
    command = subparsers.add_parser(
        "lm-eval",
        prefix_chars="\x00",
        add_help=False,
        help="lm-evaluation-harness's command line with the `composed` model registered (lm-eval's own flags, and "
        "--quiet: only the results table)",
    )
    command.add_argument("arguments", nargs="*")
    declare_paths(command, outputs=(), more=lm_eval_paths)
    command.set_defaults(func=run_lm_eval)


def run_lm_eval(args) -> int:
    """Run lm-eval's CLI on `args.arguments`; lm-eval reads `sys.argv` itself, so it is set for the call.

    `--quiet` (ours, taken out before lm-eval sees the arguments) silences lm-eval's log lines, progress
    bars and the stderr of its `git describe` (`mergecompose.integrations.lm_eval.quiet`); the results
    table and errors still show."""
    arguments = [argument for argument in args.arguments if argument != "--quiet"]
    with _argv(["lm-eval", *arguments]), quiet_lm_eval(len(arguments) < len(args.arguments)):
        harness = HarnessCLI()
        try:
            parsed = harness.parse_args()
        except SystemExit as exit_:  # argparse's own usage errors and --help
            return int(exit_.code or 0)
        harness.execute(parsed)
    return 0


@contextlib.contextmanager
def _argv(argv: list[str]):
    previous = sys.argv
    sys.argv = list(argv)
    try:
        yield
    finally:
        sys.argv = previous


_OUTPUT_FLAGS = ("--output_path", "-o")
_INPUT_FLAGS = ("--include_path", "--config", "-C")


def lm_eval_paths(args) -> tuple[list[str], list[tuple[str, str]]]:
    """The inputs and outputs named in lm-eval's own arguments: `--include_path` (task folders), `--config`, every
    value of `--model_args` (base, experts, …; lm-eval separates them with commas, lists with `|`), and
    `--output_path`, so that the results are never written over the tasks or the models."""
    arguments = list(args.arguments)
    inputs: list[str] = []
    outputs: list[tuple[str, str]] = []
    for index, argument in enumerate(arguments):
        flag, _, value = argument.partition("=")
        if not value and index + 1 < len(arguments):
            value = arguments[index + 1]
        if flag in _OUTPUT_FLAGS:
            outputs.append((flag, value))
        elif flag in _INPUT_FLAGS:
            inputs.append(value)
        elif flag == "--model_args":
            for pair in value.split(","):
                inputs.extend(pair.partition("=")[2].split("|"))
    return [path for path in inputs if path], outputs
