"""`mergecompose skills-sweep CONFIG... --out DIR`: compose k = 2, 3, 4, 6 experts and plot accuracy against k."""

from __future__ import annotations

from composition.cli_common import add_common_flags


def add_commands(subparsers) -> None:
    sweep = subparsers.add_parser(
        "skills-sweep",
        help="run skills configs (one per k) through compare with shared checkpoints; accuracy against k",
    )
    sweep.add_argument("configs", nargs="+", help="skills configs, e.g. configs/skills_k2.yaml ... configs/skills_k6.yaml")
    sweep.add_argument("--expert-noise", type=float, default=None,
                       help="the imperfect-expert variant: noise × RMS of each task-vector tensor added to every full expert")
    sweep.add_argument("--checkpoints", default=None, help="reuse this checkpoints folder (e.g. another sweep's)")
    add_common_flags(
        sweep, out="sweep folder: one run folder per config, shared checkpoints, summary", out_required=True,
        overwrite="replace results of other configs in --out", default_threads=1,
    )
    sweep.set_defaults(func=run)


def run(args) -> int:
    from transformers.utils import logging as transformers_logging

    from tasks.skills.sweep import load_sweep_configs, run_skills_sweep

    if args.expert_noise is not None and not args.expert_noise >= 0:
        raise ValueError(f"`--expert-noise` must be >= 0, got {args.expert_noise}")
    configs = load_sweep_configs(args.configs, args.expert_noise)
    transformers_logging.disable_progress_bar()
    run_skills_sweep(
        configs, args.out, overwrite=args.overwrite, progress=not args.quiet, threads=args.threads,
        checkpoints=args.checkpoints,
    )
    return 0
