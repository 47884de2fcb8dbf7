"""`mergecompose lm-eval ARGS…`: lm-eval's own command line, with the `composed` model registered.

lm-eval has no plugin hook for models, so this command imports `mergecompose.integrations.lm_eval.model` (which
registers `composed`) and then runs lm-eval's CLI on exactly the arguments given, in lm-eval's
spelling (`--model composed --model_args base=…,experts=…|… --tasks …`, `--confirm_run_unsafe_code`
for code tasks, `ls tasks`, …).
"""

from __future__ import annotations

import contextlib
import sys

from lm_eval._cli import HarnessCLI

import mergecompose.integrations.lm_eval.model  # noqa: F401  (registers the `composed` model)


def add_commands(subparsers) -> None:
    # No option of our own: a prefix character no argument starts with makes argparse hand every
    # argument (`--model`, `-h`, …) to lm-eval unchanged.
    command = subparsers.add_parser(
        "lm-eval",
        prefix_chars="\x00",
        add_help=False,
        help="lm-evaluation-harness's command line with the `composed` model registered (lm-eval's own flags)",
    )
    command.add_argument("arguments", nargs="*")
    command.set_defaults(func=run_lm_eval)


def run_lm_eval(args) -> int:
    """Run lm-eval's CLI on `args.arguments`; lm-eval reads `sys.argv` itself, so it is set for the call."""
    with _argv(["lm-eval", *args.arguments]):
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
