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
    compare.set_defaults(func=run)


def run(args) -> int:
    from tasks.compare import run_compare
    from tasks.config import load_config

    config = load_config(args.config)
    run_compare(config, args.out, overwrite=args.overwrite, progress=not args.no_progress)
    return 0
