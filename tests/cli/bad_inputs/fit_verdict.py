"""Bad input to `mergecompose fit-verdict`, refused before anything is written."""

from __future__ import annotations

import json

from bad_inputs import Case, Cli


def _missing(env):
    return Cli(["fit-verdict", "--predict", str(env.tmp / "no_sweep"), "--out", str(env.tmp / "out")])


def _before_the_paired_label(env):
    folder = env.tmp / "old_sweep"
    folder.mkdir()
    record = {"name": "s1", "family": "f", "diagnostics": {}, "outcomes": {}}
    (folder / "predict.json").write_text(json.dumps({"settings": [record]}))
    return Cli(["fit-verdict", "--predict", str(folder), "--out", str(env.tmp / "out")], inputs=[folder])


def _corrupt(env):
    folder = env.tmp / "corrupt_sweep"
    folder.mkdir()
    (folder / "results.json").write_text('{"settings": [')
    return Cli(["fit-verdict", "--real", str(folder), "--out", str(env.tmp / "out")], inputs=[folder])


def _nothing(env):
    return Cli(["fit-verdict", "--out", str(env.tmp / "out")])


CASES = [
    Case(
        "fit-verdict-a-folder-without-its-results",
        "clear",
        _missing,
        r"`--predict` must be a finished sweep folder holding predict.json, got '.*no_sweep'",
    ),
    Case(
        "fit-verdict-a-sweep-from-before-the-paired-label",
        "clear",
        _before_the_paired_label,
        r"predict.json setting 's1' has no paired label: it was written by a predict-sweep before version 2",
    ),
    Case(
        "fit-verdict-a-corrupt-results-file",
        "clear",
        _corrupt,
        r"`--real` '.*corrupt_sweep/results.json' is not JSON",
    ),
    Case(
        "fit-verdict-no-sweep-at-all",
        "clear",
        _nothing,
        r"no settings: give at least one --predict or --real folder",
    ),
]
