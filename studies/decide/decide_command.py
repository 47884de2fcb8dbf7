"""`mergecompose decide` (merge or compose these experts, measured at the lowest cost) and `mergecompose joint-task`
(a real setting's joint split as a task file for it)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml
from pydantic import ValidationError

from mergecompose.analysis.sequential_decision import DecisionSettings
from mergecompose.core.boundary import read_text_file
from mergecompose.core.cli_common import add_common_flags, declare_paths, positive_int
from mergecompose.core.io import atomic_write_text, markdown_table, validation_message
from mergecompose.studies.decide.decide_run import LABEL_TEXT, DecideConfig, PreparedDecide, run_decide
from mergecompose.studies.decide.joint_task import SCORERS, joint_task_records, task_text
from mergecompose.studies.decide.replay import replay_markdown, replay_records
from mergecompose.studies.predict.records import RECORDS_FILE, load_records
from mergecompose.studies.skill_pairs.skill_data import CONTENT_SKILLS, HELD_OUT, SKILLS

GRID_KEYS = ("merges", "weights", "remedies")


def add_commands(subparsers) -> None:
    decide = subparsers.add_parser(
        "decide",
        help="merge or compose these experts? measured on your labelled joint task, stopping as soon as an "
        "anytime-valid test decides",
        description="Chooses the best merge and the best composition on validation items, then scores both on "
        "test items in a random order and stops as soon as the sequential rule decides merge, compose, either or "
        "neither at the error rate --alpha (or at --max-items). Writes results.json and results.md into --out; "
        "an interrupted run resumes.",
    )
    decide.add_argument("--base", required=True, metavar="DIR", help="the base model: a folder or a hub id")
    decide.add_argument(
        "--expert", required=True, action="append", dest="experts", metavar="DIR",
        help="an expert: a full checkpoint or a peft LoRA adapter of the base (repeat, two or more)",
    )  # fmt: skip
    decide.add_argument("--names", nargs="+", help="the experts' names (default: their folders' names)")
    decide.add_argument(
        "--task", required=True, metavar="FILE",
        help='the labelled joint task: JSONL, {"prompt": ..., "reference": ...} on every line',
    )  # fmt: skip
    decide.add_argument(
        "--validation-task", metavar="FILE",
        help="validation items for the choices (default: --validation items of --task, drawn at random)",
    )  # fmt: skip
    decide.add_argument(
        "--scorer", default="skills",
        help=f"{', '.join(SCORERS)}, or your own as module:function(prompt, output, reference) -> bool "
        "(default skills: the real settings' lenient scorer)",
    )  # fmt: skip
    decide.add_argument(
        "--validation", type=positive_int, default=40, metavar="N", help="validation items (default 40)"
    )
    decide.add_argument(
        "--max-items", type=int, default=None, metavar="N", help="the test-item budget (default: every test item)"
    )
    decide.add_argument("--alpha", type=float, default=0.05, help="the error rate, in (0, 0.5) (default 0.05)")
    decide.add_argument(
        "--delta", type=float, default=0.10, help="'either': accuracies within ±delta, in (0, 1) (default 0.10)"
    )
    decide.add_argument(
        "--grid", metavar="YAML",
        help="the candidates: a YAML with any of merges (method: {lam: [...], density: [...]}, ≤ 3 points each), "
        "weights (≤ 3) and remedies (name: {gate: 0.1}), as real-sweep's config writes them",
    )  # fmt: skip
    decide.add_argument("--seed", type=int, default=0, help="the items' random order (default 0)")
    decide.add_argument("--max-new-tokens", type=positive_int, default=48, metavar="N", help="(default 48)")
    decide.add_argument("--batch-size", type=positive_int, default=8, metavar="N", help="(default 8)")
    add_common_flags(
        decide, out="run folder: results.json, results.md, the cells (a rerun resumes)", out_required=True, check=True
    )
    declare_paths(
        decide,
        inputs=("base", "experts", "task", "validation_task"),
        configs=("grid",),
        not_paths=("names", "scorer"),
    )
    decide.set_defaults(
        func=run_decide_command,
        preflight=preflight_decide_command,
        interrupted=lambda args: (
            f"interrupted (Ctrl-C); every item scored so far is kept in {args.out}, and the "
            "same command resumes from it"
        ),
    )

    joint = subparsers.add_parser(
        "joint-task",
        help="a real setting's joint split (two skills of the skill-pairs data generator) as a task file for decide",
    )
    joint.add_argument("first", help=f"a content skill: {', '.join(CONTENT_SKILLS)}")
    joint.add_argument("second", help=f"a second skill: {', '.join(SKILLS)}")
    joint.add_argument("--split", choices=HELD_OUT, default="test", help="(default test)")
    joint.add_argument("--items", type=positive_int, default=200, metavar="N", help="(default 200)")
    joint.add_argument("--seed", type=int, default=0, help="(default 0, as real-sweep)")
    joint.add_argument("--out", required=True, metavar="FILE", help="the JSONL to write")
    joint.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    add_common_flags(joint)
    declare_paths(joint, output_files=("out",), not_paths=("first", "second", "split"))
    joint.set_defaults(func=run_joint_task_command)

    replay = subparsers.add_parser(
        "decide-replay",
        help="replay decide's sequential rule over a records file's settings in random orders: agreement with the "
        "full-n label, wrong decisions, test items used",
    )
    replay.add_argument("--records", required=True, metavar="FILE", help=f"a records file, e.g. {RECORDS_FILE}")
    replay.add_argument("--orders", type=positive_int, default=100, metavar="N", help="random orders per setting (100)")
    replay.add_argument("--seed", type=int, default=0, help="(default 0)")
    replay.add_argument("--alpha", type=float, default=0.05, help="the error rate, in (0, 0.5) (default 0.05)")
    replay.add_argument("--delta", type=float, default=0.10, help="'either' margin, in (0, 1) (default 0.10)")
    add_common_flags(replay, out="folder: replay.json, replay.md", out_required=True)
    declare_paths(replay, inputs=("records",))
    replay.set_defaults(func=run_replay_command)


def _grid(path: str | None) -> dict:
    if path is None:
        return {}
    text = read_text_file(path, "--grid")
    try:
        values = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        raise ValueError(f"`--grid` {path!r} is not YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(values, dict) or not set(values) <= set(GRID_KEYS):
        keys = sorted(values) if isinstance(values, dict) else type(values).__name__
        raise ValueError(f"`--grid` {path!r} must be a mapping of {', '.join(GRID_KEYS)}; got {keys}")
    return values


def preflight_decide_command(args: argparse.Namespace) -> PreparedDecide:
    """Every input checked before any model loads (`--check` stops here)."""
    if args.max_items is not None and args.max_items < 1:
        raise ValueError(f"`--max-items` must be at least 1, got {args.max_items}")
    if not 0 < args.alpha < 0.5:
        raise ValueError(f"`--alpha` must be in (0, 0.5), got {args.alpha}")
    if not 0 < args.delta < 1:
        raise ValueError(f"`--delta` must be in (0, 1), got {args.delta}")
    if len(args.experts) < 2:
        raise ValueError(
            f"`--expert` must be given at least twice (two experts to merge or compose), got {args.experts}"
        )
    values = {
        "base": args.base,
        "experts": args.experts,
        "names": args.names,
        "task": args.task,
        "validation_task": args.validation_task,
        "scorer": args.scorer,
        "validation": args.validation,
        "max_items": args.max_items,
        "alpha": args.alpha,
        "delta": args.delta,
        "seed": args.seed,
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        **_grid(args.grid),
    }
    try:
        config = DecideConfig.model_validate(values)
    except ValidationError as error:
        raise ValueError(f"decide: {validation_message(error)}") from None
    return PreparedDecide(config)


def run_decide_command(args: argparse.Namespace) -> int:
    results = run_decide(args.prepared, args.out, overwrite=args.overwrite, progress=not args.quiet)
    decision = results["decision"]
    n = decision["items"]
    print(
        markdown_table(
            ["system", "chosen", "right", "anytime 95 % bounds"],
            [
                [
                    kind,
                    results["chosen"][key],
                    f"{decision[f'{key}_right']} / {n}",
                    _bounds(decision[f"{key}_interval"]),
                ]
                for kind, key in (("merge", "merge"), ("composition", "compose"))
            ],
        )
    )
    budget = " (budget reached: the fixed-n test's label)" if results["budget_reached"] else ""
    print(f"\n{LABEL_TEXT[results['label']]}{budget}; {n} of {results['test_items_available']} test items used")
    if not args.quiet:
        print(f"\nwrote {args.out}/results.json, results.md, config.yaml")
    return 0


def _bounds(bounds) -> str:
    return f"[{100 * bounds[0]:.1f} %, {100 * bounds[1]:.1f} %]"


def run_joint_task_command(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and (not args.overwrite or not out.is_file()):
        raise FileExistsError(f"`--out` {args.out!r} exists; pass --overwrite to replace it (a regular file only)")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"`--out` {args.out!r}: its folder {str(out.parent)!r} does not exist")
    records = joint_task_records(args.first, args.second, args.split, args.items, args.seed)
    atomic_write_text(args.out, task_text(records))
    if not args.quiet:
        print(f"wrote {len(records)} {args.first} + {args.second} items ({args.split} split) to {args.out}")
    return 0


def run_replay_command(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise FileExistsError(f"`--out` {args.out!r} exists; pass --overwrite to replace it")
    records = load_records(args.records)
    settings = DecisionSettings(alpha=args.alpha, delta=args.delta, floor=records.floor)
    results = replay_records(records, args.orders, args.seed, settings)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "replay.json", json.dumps(results, indent=1) + "\n")
    text = replay_markdown(results)
    atomic_write_text(out / "replay.md", text)
    print(text.split("\n\n")[2])
    if not args.quiet:
        print(f"\nwrote {args.out}/replay.json, replay.md")
    return 0
