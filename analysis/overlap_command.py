"""`mergecompose overlap`: where expert logit deltas overlap, projectivity, and merge ≈ compose."""

from __future__ import annotations

from mergecompose.analysis.overlap_report import recommendation_text, terminal_table
from mergecompose.analysis.overlap_run import OverlapRunConfig, preflight_overlap, read_overlap_yaml, run_overlap
from mergecompose.core.cli_common import add_common_flags, declare_paths


def add_commands(subparsers) -> None:
    overlap = subparsers.add_parser(
        "overlap",
        help="measure overlap of expert logit deltas, projective error and the merge-vs-compose gap",
        description="Flags override the values of --config. Writes overlap.json, overlap.md, config.yaml, "
        "activity_heatmap.png and (with --merged) gap_histogram.png into --out.",
    )
    overlap.add_argument(
        "--config", help="YAML file with the fields of mergecompose.analysis.overlap_run.OverlapRunConfig"
    )
    overlap.add_argument("--base", help="base checkpoint folder or hub id")
    overlap.add_argument("--expert", action="append", dest="experts", help="expert checkpoint or adapter (repeat)")
    overlap.add_argument("--merged", help="the task-arithmetic merge θ_b + λΣτ_i (checkpoint or adapter)")
    overlap.add_argument("--data", help='jsonl with {"text": ...} or {"prompt": ..., "completion": ...} records')
    overlap.add_argument("--tokenizer", help="tokenizer folder (default: the base's)")
    overlap.add_argument("--lam", type=float, help="λ: composition exponent of every expert and the merge's scale")
    overlap.add_argument("--batch-size", type=int, dest="batch_size")
    overlap.add_argument("--max-length", type=int, dest="max_length")
    overlap.add_argument("--max-records", type=int, dest="max_records")
    overlap.add_argument(
        "--truncate",
        action="store_true",
        default=None,
        help="cut records longer than --max-length (or the base's context) instead of refusing them; "
        "says how many were cut",
    )
    overlap.add_argument(
        "--rollouts",
        action="append",
        help="also measure on greedy rollouts of: composed, base, experts, expert:NAME (repeat)",
    )
    overlap.add_argument(
        "--expert-data",
        action="append",
        dest="expert_data",
        metavar="NAME=FILE",
        help="an expert's own prompts (jsonl, as --data): its retention by the merge and the composition on its "
        "greedy outputs from them (repeat, one per expert)",
    )
    overlap.add_argument("--max-new-tokens", type=int, dest="max_new_tokens")
    overlap.add_argument(
        "--prompt-tokens", type=int, dest="prompt_tokens", help="rollout prompt length for text records"
    )
    overlap.add_argument("--density", type=float, dest="parameter_density", help="TIES trim density (default 0.2)")
    overlap.add_argument("--no-parameter-measures", action="store_false", dest="parameter_measures", default=None)
    overlap.add_argument("--device", choices=["auto", "cpu", "cuda"])
    overlap.add_argument("--epsilon", type=float, help="activity / support threshold ε in nats (default 0.1)")
    overlap.add_argument("--eta", type=float, help="support probability floor η (default 1e-3)")
    overlap.add_argument("--seed", type=int, help="reservoir seed")
    overlap.add_argument(
        "--centre",
        choices=["base_weighted_median", "median"],
        help="how each delta is centred over the vocabulary "
        "(default base_weighted_median; median: each token counted once)",
    )
    overlap.add_argument(
        "--full-vocabulary",
        action="store_true",
        default=None,
        dest="full_vocabulary",
        help="compute the centre, supports, overlap sums and top tokens over the whole vocabulary at every position, "
        "instead of on the top-k union (whose outside mass the report gives)",
    )
    overlap.add_argument("--candidates", type=int, help="tokens in the top-k union per position (default 256)")
    overlap.add_argument(
        "--recommend",
        action="store_true",
        default=None,
        help="say whether to merge or compose these experts: the unlabelled diagnostics on the composition's rollouts "
        "from --data's prompts, read by the verdict rule fitted by `mergecompose predict-sweep` on synthetic tasks",
    )
    overlap.add_argument("--rule", help="with --recommend: a predict_rule.json to use instead of the shipped one")
    add_common_flags(overlap, out="output folder (refused if it exists, unless --overwrite)", check=True)
    declare_paths(
        overlap,
        inputs=("base", "experts", "merged", "data", "tokenizer"),
        configs=("config", "rule"),
        more=expert_data_paths,
        through_more=("expert_data",),
    )
    overlap.set_defaults(overwrite=None)  # unset: the config's `overwrite` (or its default) applies
    overlap.set_defaults(func=run_overlap_command, preflight=preflight_overlap_command)


_SETTINGS_FLAGS = ("epsilon", "eta", "seed", "centre", "full_vocabulary", "candidates")
_RUN_FLAGS = (
    "base",
    "experts",
    "merged",
    "data",
    "out",
    "overwrite",
    "tokenizer",
    "lam",
    "batch_size",
    "max_length",
    "max_records",
    "truncate",
    "rollouts",
    "max_new_tokens",
    "prompt_tokens",
    "parameter_density",
    "parameter_measures",
    "device",
    "recommend",
    "rule",
)


def name_and_file(value: str) -> tuple[str, str]:
    """`--expert-data`'s NAME=FILE, split at the first `=`; refused, naming the value, without one."""
    name, sign, path = value.partition("=")
    if not sign or not name or not path:
        raise ValueError(f"`--expert-data` must be NAME=FILE (an expert's name, then its prompts), got {value!r}")
    return name, path


def expert_data_paths(args) -> tuple[list[str], list[tuple[str, str]]]:
    """The files `--expert-data` reads (inputs), and no outputs."""
    return [value.partition("=")[2] for value in args.expert_data or [] if "=" in value], []


def config_from_args(args):
    """YAML (if any) first, then every flag that was given; validated as `OverlapRunConfig`."""
    values = read_overlap_yaml(args.config) if args.config else {}
    for name in _RUN_FLAGS:
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.expert_data:
        pairs = [name_and_file(value) for value in args.expert_data]
        names = [name for name, _ in pairs]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"`--expert-data` names {', '.join(repeated)} more than once; give one file per expert")
        values["expert_data"] = {**(values.get("expert_data") or {}), **dict(pairs)}
    settings = dict(values.get("settings") or {})
    for name in _SETTINGS_FLAGS:
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    values["settings"] = settings
    return OverlapRunConfig.model_validate(values)


def preflight_overlap_command(args) -> None:
    preflight_overlap(config_from_args(args))


def run_overlap_command(args) -> int:
    config = config_from_args(args)
    results = run_overlap(config, progress=not args.quiet)  # its warnings: one line each (mergecompose.cli.main)
    print(terminal_table(results))
    if "recommendation" in results:
        print()
        print(recommendation_text(results["recommendation"]))
    if not args.quiet:
        print(f"\nwrote {config.out}/overlap.json, overlap.md, config.yaml and plots")
    return 0
