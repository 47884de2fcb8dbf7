"""`mergecompose export-records`: every setting's per-item right/wrong from finished sweep folders, into one file
(`mergecompose.studies.predict.records`), and the count of the labels recomputed from them."""

from __future__ import annotations

from pathlib import Path

from mergecompose.analysis.paired_outcome import OUTCOMES
from mergecompose.core.cli_common import add_common_flags, declare_paths
from mergecompose.core.io import markdown_table
from mergecompose.studies.predict.records import export_records, relabel_counts, write_records


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
    export.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    add_common_flags(export)
    declare_paths(export, inputs=("real", "predict"), outputs=(), output_files=("out",))
    export.set_defaults(func=run_export_records)


def run_export_records(args) -> int:
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise FileExistsError(f"`--out` {args.out!r} exists; give --overwrite to replace it")
    records = export_records(args.real, args.predict)
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
