"""`mergecompose compare CONFIG --out DIR`: train, merge, compose, evaluate, and print the table."""

from __future__ import annotations


def add_commands(subparsers) -> None:
    compare = subparsers.add_parser(
        "compare",
        help="train a base and its experts, build every merge and the composition, evaluate all on the same data",
    )
    compare.add_argument("config", help="a YAML config, e.g. configs/letters.yaml")
    compare.add_argument("--out", required=True, help="run folder: results, plots and cached checkpoints")
    compare.add_argument("--overwrite", action="store_true", help="replace results of another config in --out")
    compare.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    compare.add_argument("--threads", type=int, default=1, help="torch threads (default 1: fastest for these tiny models)")
    compare.set_defaults(func=run)


def run(args) -> int:
    from transformers.utils import logging as transformers_logging

    from tasks.compare import run_compare
    from tasks.config import load_config

    if args.threads < 1:
        raise ValueError(f"`--threads` must be >= 1, got {args.threads}")
    config = load_config(args.config)
    transformers_logging.disable_progress_bar()  # one "Loading weights" bar per checkpoint load otherwise
    run_compare(config, args.out, overwrite=args.overwrite, progress=not args.no_progress, threads=args.threads)
    return 0
