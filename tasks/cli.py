"""`mergecompose compare CONFIG --out DIR`: train, merge, compose, evaluate, and print the table."""

from __future__ import annotations

from composition.cli_common import add_common_flags


def add_commands(subparsers) -> None:
    compare = subparsers.add_parser(
        "compare",
        help="train a base and its experts, build every merge and the composition, evaluate all on the same data",
    )
    compare.add_argument("config", help="a YAML config, e.g. configs/letters.yaml")
    add_common_flags(  # one torch thread is the fastest for these tiny models
        compare, out="run folder: results, plots and cached checkpoints", out_required=True,
        overwrite="replace results of another config in --out", default_threads=1,
    )
    compare.set_defaults(func=run)


def run(args) -> int:
    from transformers.utils import logging as transformers_logging

    from tasks.compare import run_compare
    from tasks.config import load_config

    config = load_config(args.config)
    transformers_logging.disable_progress_bar()  # one "Loading weights" bar per checkpoint load otherwise
    run_compare(config, args.out, overwrite=args.overwrite, progress=not args.quiet, threads=args.threads)
    return 0
