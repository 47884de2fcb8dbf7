"""`mergecompose compare`: a base and its experts, every merge and the composition, scored on the same data (the
synthetic task types, and the compare kinds such as `type: lm_eval`)."""

from __future__ import annotations

from transformers.utils import logging as transformers_logging

from mergecompose.core.cli_common import add_common_flags, declare_paths, interrupted_run_folder
from mergecompose.experiments.compare import preflight_compare, run_compare
from mergecompose.experiments.compare_config import load_config
from mergecompose.experiments.executors import add_executor_flags, executor_from_flags
from mergecompose.experiments.plugins import compare_kind_of


def add_commands(subparsers) -> None:
    compare = subparsers.add_parser(
        "compare",
        help="train a base and its experts, build every merge and the composition, evaluate all on the same data",
    )
    compare.add_argument("config", help="a YAML config, e.g. configs/letters.yaml")
    add_common_flags(  # one torch thread is the fastest for these tiny models
        compare,
        out="run folder: results, plots and cached checkpoints",
        out_required=True,
        overwrite="replace results of another config in --out",
        default_threads=1,
        check=True,
    )
    add_executor_flags(compare)
    declare_paths(compare, configs=("config",), not_paths=("executor", "ray_address"))
    compare.set_defaults(
        func=run_compare_command, preflight=preflight_compare_command, interrupted=interrupted_run_folder
    )


def preflight_compare_command(args):
    """The config, read and validated once, and the compare's pre-flight, run once; `run_compare_command` gets the
    config as `args.prepared`."""
    config = load_config(args.config)
    preflight_compare(config, args.out, args.overwrite, args.config)
    if args.executor != "local" and compare_kind_of(config) is None:
        raise ValueError(
            f"`--executor {args.executor}` runs the cells of a compare kind that caches per cell (`type: lm_eval`); "
            f"{args.config} is a compare of the synthetic task types, which runs here (--executor local)"
        )
    args.cell_executor = executor_from_flags(args)
    return config


def run_compare_command(args) -> int:
    transformers_logging.disable_progress_bar()  # one "Loading weights" bar per checkpoint load otherwise
    run_compare(
        args.prepared,
        args.out,
        overwrite=args.overwrite,
        progress=not args.quiet,
        threads=args.threads,
        checked=True,
        executor=args.cell_executor,
    )
    return 0
