"""The `mergecompose` command line. Each package adds its own subcommands; this file only gathers them."""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that define `add_commands(subparsers)`; each subcommand sets `func(args) -> int`.
_COMMAND_MODULES = ["composition.cli", "merging.cli", "analysis.cli", "tasks.cli", "tasks.skills_cli"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mergecompose", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in _COMMAND_MODULES:
        importlib.import_module(module_name).add_commands(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
