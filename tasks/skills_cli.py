"""`mergecompose skills-sweep CONFIG... --out DIR`: compose k = 2, 3, 4, 6 experts and plot accuracy against k."""

from __future__ import annotations


def add_commands(subparsers) -> None:
    sweep = subparsers.add_parser(
        "skills-sweep",
        help="run skills configs (one per k) through compare with shared checkpoints; accuracy against k",
    )
    sweep.add_argument("configs", nargs="+", help="skills configs, e.g. configs/skills_k2.yaml ... configs/skills_k6.yaml")
    sweep.add_argument("--out", required=True, help="sweep folder: one run folder per config, shared checkpoints, summary")
    sweep.add_argument("--expert-noise", type=float, default=None,
                       help="the imperfect-expert variant: noise × RMS of each task-vector tensor added to every full expert")
    sweep.add_argument("--checkpoints", default=None, help="reuse this checkpoints folder (e.g. another sweep's)")
    sweep.add_argument("--overwrite", action="store_true", help="replace results of other configs in --out")
    sweep.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    sweep.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    sweep.set_defaults(func=run)


def run(args) -> int:
    from transformers.utils import logging as transformers_logging

    from tasks.skills_sweep import load_sweep_configs, run_skills_sweep

    if args.threads < 1:
        raise ValueError(f"`--threads` must be >= 1, got {args.threads}")
    if args.expert_noise is not None and not args.expert_noise >= 0:
        raise ValueError(f"`--expert-noise` must be >= 0, got {args.expert_noise}")
    configs = load_sweep_configs(args.configs, args.expert_noise)
    transformers_logging.disable_progress_bar()
    run_skills_sweep(
        configs, args.out, overwrite=args.overwrite, progress=not args.no_progress, threads=args.threads,
        checkpoints=args.checkpoints,
    )
    return 0
