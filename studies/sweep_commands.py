"""The studies' sweeps: `mergecompose skills-sweep`, `overlap-sweep` and `predict-sweep` (`real-sweep`, which needs
the real-model extra, is in `mergecompose.studies.skill_pairs.real_sweep_command`), and `fit-verdict`, the paired
verdict fitted on their results."""

from __future__ import annotations

from transformers.utils import logging as transformers_logging

from mergecompose.analysis.overlap_report import format_number
from mergecompose.core.cli_common import (
    add_common_flags,
    check_free_disk,
    declare_paths,
    interrupted_cells,
    interrupted_run_folder,
)
from mergecompose.core.io import load_yaml_config, markdown_table
from mergecompose.experiments.compare import synthetic_checkpoint_bytes
from mergecompose.experiments.executors import add_executor_flags, executor_from_flags
from mergecompose.studies.letters.overlap_sweep import SweepConfig, preflight_overlap_sweep, run_sweep
from mergecompose.studies.predict import PredictConfig, preflight_predict, run_predict_sweep
from mergecompose.studies.predict.paired_verdict import BASELINES
from mergecompose.studies.predict.paired_verdict_report import run_fit_verdict
from mergecompose.studies.predict.predict_report import ranked
from mergecompose.studies.skills.skills_sweep import load_sweep_configs, run_skills_sweep


def add_commands(subparsers) -> None:
    skills = subparsers.add_parser(
        "skills-sweep",
        help="run skills configs (one per k) through compare with shared checkpoints; accuracy against k",
    )
    skills.add_argument(
        "configs", nargs="+", help="skills configs, e.g. configs/skills_k2.yaml ... configs/skills_k6.yaml"
    )
    skills.add_argument(
        "--expert-noise",
        type=float,
        default=None,
        help="the imperfect-expert variant: noise × RMS of each task-vector tensor added to every full expert",
    )
    skills.add_argument("--checkpoints", default=None, help="reuse this checkpoints folder (e.g. another sweep's)")
    add_common_flags(
        skills,
        out="sweep folder: one run folder per config, shared checkpoints, summary",
        out_required=True,
        overwrite="replace results of other configs in --out",
        default_threads=1,
        check=True,
    )
    declare_paths(skills, configs=("configs",), caches=("checkpoints",))
    skills.set_defaults(
        func=run_skills_sweep_command, preflight=preflight_skills_sweep_command, interrupted=interrupted_run_folder
    )

    sweep = subparsers.add_parser(
        "overlap-sweep",
        help="train letter experts for many rule pairs; "
        "correlate output-space overlap with composition and merge error",
    )
    sweep.add_argument(
        "config",
        help="a sweep YAML (mergecompose.studies.letters.overlap_sweep.SweepConfig), e.g. configs/sweep_letters.yaml",
    )
    add_common_flags(
        sweep,
        out="run folder: sweep.json, sweep.md, plots, cached checkpoints",
        out_required=True,
        overwrite="replace the results of another config in --out",
        default_threads=1,
        check=True,
    )
    declare_paths(sweep, configs=("config",))
    sweep.set_defaults(
        func=run_overlap_sweep_command, preflight=preflight_overlap_sweep_command, interrupted=interrupted_run_folder
    )

    predict = subparsers.add_parser(
        "predict-sweep",
        help="merge or compose? unlabelled diagnostics against composition and merge outcomes over many settings; "
        "fits the verdict rule",
    )
    predict.add_argument(
        "config", help="a predict YAML (mergecompose.studies.predict.PredictConfig), e.g. configs/predict.yaml"
    )
    add_common_flags(
        predict,
        out="sweep folder: predict.json, predict.md, predict_rule.json, plots, cached checkpoints "
        "and per-setting results "
        "(an interrupted sweep resumes from them)",
        out_required=True,
        overwrite="replace the results of another config in --out "
        "(per-setting results still count where their inputs match)",
        default_threads=1,
        check=True,
    )
    add_executor_flags(predict)
    declare_paths(predict, configs=("config",), not_paths=("executor", "ray_address"))
    predict.set_defaults(
        func=run_predict_sweep_command, preflight=preflight_predict_sweep_command, interrupted=interrupted_cells
    )

    verdict = subparsers.add_parser(
        "fit-verdict",
        help="merge or compose? fit the paired verdict on predict-sweep and real-sweep results; score it held out "
        "(no setting scored by a rule fitted on a setting sharing its experts) against three baselines",
    )
    verdict.add_argument(
        "--predict", action="append", default=[], metavar="DIR", help="a finished predict-sweep folder (repeatable)"
    )
    verdict.add_argument(
        "--real", action="append", default=[], metavar="DIR", help="a finished real-sweep folder (repeatable)"
    )
    add_common_flags(
        verdict,
        out="folder: verdict.json, verdict.md, paired_rule.json, diagnostics_vs_gap.png",
        out_required=True,
        overwrite="replace the results of other sweeps in --out",
    )
    declare_paths(verdict, inputs=("predict", "real"))
    verdict.set_defaults(func=run_fit_verdict_command)


def preflight_skills_sweep_command(args):
    """The noise, every config (loaded and validated), and the disk for all their checkpoints; the configs go to
    `run_skills_sweep_command` as `args.prepared`."""
    if args.expert_noise is not None and not args.expert_noise >= 0:
        raise ValueError(f"`--expert-noise` must be >= 0, got {args.expert_noise}")
    configs = load_sweep_configs(args.configs, args.expert_noise)
    needed = sum(synthetic_checkpoint_bytes(config) for config in configs)
    check_free_disk(args.out, needed, f"the checkpoints of {len(configs)} skills configs")
    return configs


def run_skills_sweep_command(args) -> int:
    configs = args.prepared
    transformers_logging.disable_progress_bar()
    run_skills_sweep(
        configs,
        args.out,
        overwrite=args.overwrite,
        progress=not args.quiet,
        threads=args.threads,
        checkpoints=args.checkpoints,
    )
    return 0


def preflight_overlap_sweep_command(args) -> SweepConfig:
    config = load_yaml_config(args.config, SweepConfig, "sweep config")
    preflight_overlap_sweep(config, args.config)
    return config


def run_overlap_sweep_command(args) -> int:
    config = args.prepared
    transformers_logging.disable_progress_bar()
    results = run_sweep(
        config, args.out, overwrite=args.overwrite, progress=not args.quiet, config_path=args.config
    )  # `main` applies --threads
    keys = [
        "pair",
        "mass_overlap",
        "mass_overlap_weighted",
        "sign_conflict",
        "linearization_error",
        "compose_accuracy",
        "merge_accuracy",
        "merge_method",
    ]
    print(markdown_table(keys, [[row[key] for key in keys] for row in results["rows"]], cell=format_number, pad=True))
    for name, correlation in results["statistics"]["spearman"].items():
        print(
            f"Spearman {name}: rho={format_number(correlation['rho'])} "
            f"p={format_number(correlation['p_value'])} n={correlation['n']}"
        )
    if not args.quiet:
        print(f"\nwrote {args.out}/sweep.json, sweep.md, overlap_vs_error.png, config.yaml")
    return 0


def preflight_predict_sweep_command(args) -> PredictConfig:
    config = load_yaml_config(args.config, PredictConfig, "predict config")
    preflight_predict(config, args.config)
    args.cell_executor = executor_from_flags(args)
    return config


def run_predict_sweep_command(args) -> int:
    config = args.prepared
    transformers_logging.disable_progress_bar()
    results = run_predict_sweep(
        config,
        args.out,
        overwrite=args.overwrite,
        progress=not args.quiet,
        echo=None if args.quiet else print,
        config_path=args.config,
        executor=args.cell_executor,
    )
    top = ranked(results, "spearman_compose_error")[:3]
    keys = ["name", "family", "compose", "best_remedy", "best_merge"]
    rows = [
        [r["name"], r["family"], *(r["outcomes"][k] for k in keys[2:]), *(r["diagnostics"][n] for n in top)]
        for r in results["settings"]
    ]
    print(markdown_table([*keys, *top], rows, cell=format_number, pad=True))
    for key, entry in results["best"].items():
        print(f"best {key}: {entry['diagnostic']} rho={format_number(entry['rho'])} ci95={entry['ci95']}")
    verdict = results["verdict"]
    print(
        "verdict rule, leave-one-family-out: "
        f"accuracy {format_number(verdict['heldout_accuracy'])} over {verdict['n_settings']} settings"
    )
    if not args.quiet:
        print(f"\nwrote {args.out}/predict.json, predict.md, predict_rule.json, config.yaml and scatter plots")
    return 0


def run_fit_verdict_command(args) -> int:
    results = run_fit_verdict(args.predict, args.real, args.out, overwrite=args.overwrite)
    for subset in ("real", "all"):
        report = results["heldout"][subset]
        if not report["rule"]["n"]:
            continue
        cells = [f"rule {format_number(report['rule']['accuracy'])} {report['rule']['ci95']}"]
        cells += [f"{name} {format_number(report['baselines'][name]['accuracy'])}" for name in BASELINES]
        print(f"{subset} settings, held out (n = {report['rule']['n']}): " + ", ".join(cells))
    if not args.quiet:
        print(f"\nwrote {args.out}/verdict.json, verdict.md, paired_rule.json, diagnostics_vs_gap.png")
    return 0
