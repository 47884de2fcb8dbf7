"""`mergecompose export-records`: every setting's per-item right/wrong from finished sweep folders, into one file
(`mergecompose.studies.predict.records`), and the count of the labels recomputed from them; `score-rule`: the
shipped verdict rule on a records file's real settings; `fit-rule`: the four-label rule refitted on a records file
and scored held out against the constants (`mergecompose.studies.predict.label_fit`)."""

from __future__ import annotations

import json
from pathlib import Path

from mergecompose.analysis.overlap_report import json_safe
from mergecompose.analysis.paired_outcome import OUTCOMES
from mergecompose.analysis.predict import load_rule
from mergecompose.analysis.real_settings_score import score_on_real_settings
from mergecompose.core.cli_common import add_common_flags, declare_paths
from mergecompose.core.io import atomic_write_text, markdown_table
from mergecompose.experiments.compare_config import fingerprint
from mergecompose.experiments.run_folder import FolderLayout, RunFolder
from mergecompose.studies.predict.label_fit import refit, refit_markdown
from mergecompose.studies.predict.records import (
    RECORDS_FILE,
    SettingsRecords,
    export_records,
    load_records,
    relabel_counts,
    write_records,
)


def add_commands(subparsers) -> None:
    export = subparsers.add_parser(
        "export-records",
        help="gather every setting's per-item right/wrong from finished real-sweep and predict-sweep folders into "
        "one versioned JSON file, each label recomputed (with 'neither'); prints the recount",
    )
    export.add_argument(
        "--real", action="append", default=[], metavar="DIR", help="a finished real-sweep folder (repeatable)"
    )
    export.add_argument(
        "--predict", action="append", default=[], metavar="DIR", help="a finished predict-sweep folder (repeatable)"
    )
    export.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        help="the records file to write, e.g. docs/results/data/settings_records.json",
    )
    export.add_argument(
        "--keep",
        metavar="FILE",
        help="a records file whose sweeps and settings are kept (but for the sweeps given again): to add a sweep to "
        "a file without the folders of the sweeps it holds",
    )
    export.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    add_common_flags(export)
    declare_paths(export, inputs=("real", "predict", "keep"), outputs=(), output_files=("out",))
    export.set_defaults(func=run_export_records)

    score = subparsers.add_parser(
        "score-rule",
        help="measure a verdict rule on the real settings of a records file (its verdicts against their paired "
        "labels, and the best constant) and write the rule with those figures, which overlap --recommend prints",
    )
    score.add_argument("--rule", metavar="FILE", help="a predict_rule.json (default: the shipped rule)")
    score.add_argument("--records", required=True, metavar="FILE", help=f"a records file, e.g. {RECORDS_FILE}")
    score.add_argument("--out", required=True, metavar="FILE", help="the rule file to write, with its figures")
    score.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    add_common_flags(score)
    declare_paths(score, inputs=("records",), configs=("rule",), outputs=(), output_files=("out",))
    score.set_defaults(func=run_score_rule)

    fit = subparsers.add_parser(
        "fit-rule",
        help="refit the four-label rule (merge, compose, either, neither; one or two diagnostics) on a records file, "
        "scored held out on its real settings (no setting scored by a rule fitted on one sharing an expert) against "
        "always merge, compose, either, neither and the majority label; and which diagnostics track the label",
    )
    fit.add_argument("--records", required=True, metavar="FILE", help=f"a records file, e.g. {RECORDS_FILE}")
    add_common_flags(
        fit,
        out="folder: results.json, results.md, label_rule.json",
        out_required=True,
        overwrite="replace the results of another records file in --out",
    )
    declare_paths(fit, inputs=("records",))
    fit.set_defaults(func=run_fit_rule)


def real_settings_of(records: SettingsRecords) -> list[tuple[str, dict]]:
    """(paired label, diagnostics) of every real setting of `records`."""
    settings = [(setting.label, setting.diagnostics) for setting in records.settings if setting.source == "real"]
    if not settings:
        raise ValueError("`--records` holds no real setting: the rule is measured on real settings only")
    return settings


def run_score_rule(args) -> int:
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise FileExistsError(f"`--out` {args.out!r} exists; give --overwrite to replace it")
    rule = load_rule(args.rule)
    records = load_records(args.records)
    source = f"{Path(args.records).name} v{records.version} ({records.made.commit}, {records.made.date})"
    score = score_on_real_settings(rule, real_settings_of(records), source)
    scored = rule.model_copy(update={"real_settings": score})
    atomic_write_text(out, json.dumps(json_safe(scored.model_dump(mode="json")), indent=1) + "\n")
    best = score.best_constant
    print(
        f"on {score.n} real settings: the rule {100 * score.accuracy:.1f} % [{100 * score.interval[0]:.1f}, "
        f"{100 * score.interval[1]:.1f}] ({score.undecided} undecided); always '{best.label}' "
        f"{100 * best.accuracy:.1f} %"
    )
    if not args.quiet:
        print(f"wrote {args.out}")
    return 0


FIT_RULE_FOLDER = FolderLayout(
    "a fit-rule folder",
    results="results.json",
    cached=(),
    owns=("results.json", "results.md", "label_rule.json"),
)


def run_fit_rule(args) -> int:
    records = load_records(args.records)
    run = RunFolder(args.out, FIT_RULE_FOLDER)
    config_hash = fingerprint(records)
    run.check(config_hash, args.overwrite)  # before any fitting
    results = {
        "config_hash": config_hash,
        "records": f"{args.records} v{records.version} ({records.made.commit}, {records.made.date})",
        **refit(records.settings),
    }
    with run.claim(config_hash, args.overwrite):
        run.write_json("results.json", results, finite=True)
        run.write_json("label_rule.json", results["fits"]["all"]["rule"], finite=True)
        run.write_text("results.md", refit_markdown(results))
    for train, fit in results["fits"].items():
        held = fit["heldout"]
        cells = [f"rule {_share(held['rule'])}"]
        cells += [f"{name} {_share(score)}" for name, score in held["baselines"].items()]
        print(f"fitted on {train} settings, {fit['n_scored']} real settings held out: " + ", ".join(cells))
    if not args.quiet:
        print(f"\nwrote {args.out}/results.json, results.md, label_rule.json")
    return 0


def _share(score: dict) -> str:
    return "–" if score["accuracy"] is None else f"{100 * score['accuracy']:.1f} %"


def run_export_records(args) -> int:
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise FileExistsError(f"`--out` {args.out!r} exists; give --overwrite to replace it")
    keep = None if args.keep is None else load_records(args.keep)
    records = export_records(args.real, args.predict, keep=keep)
    write_records(records, out)
    print(relabel_table(relabel_counts(records)))
    if not args.quiet:
        print(f"\nwrote {args.out}: {len(records.settings)} settings from {len(records.sweeps)} sweeps")
    return 0


def relabel_table(counts: dict) -> str:
    """The new labels per source, and for all settings the sweeps' labels (rows) against the new ones (columns)."""
    header = ["source", "settings", *OUTCOMES, "changed"]
    rows = [
        [source, entry["settings"], *entry["labels"].values(), entry["changed"]]
        for source, entry in counts.items()
        if entry["settings"]
    ]
    crosstab = counts["all"]["crosstab"]
    lines = [markdown_table(header, rows, pad=True), "", "previous label (rows) -> new label (columns), all settings"]
    lines.append(markdown_table(["previous", *OUTCOMES], [[p, *row.values()] for p, row in crosstab.items()], pad=True))
    return "\n".join(lines)
