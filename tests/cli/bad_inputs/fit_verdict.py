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


def _finished_sweep(env, name: str = "sweep"):
    folder = env.tmp / name
    folder.mkdir()
    (folder / "predict.json").write_text(json.dumps({"settings": []}))
    return folder


def _a_sweep_twice(env):
    folder = _finished_sweep(env)
    argv = ["fit-verdict", "--predict", str(folder), "--predict", f"{folder}/", "--out", str(env.tmp / "out")]
    return Cli(argv, inputs=[folder])


def _into_another_commands_folder(env, overwrite: bool):
    folder = _finished_sweep(env)
    other = env.tmp / "real_sweep_run"
    (other / "checkpoints").mkdir(parents=True)
    (other / "results.json").write_text("{}")
    argv = ["fit-verdict", "--predict", str(folder), "--out", str(other), *(["--overwrite"] if overwrite else [])]
    return Cli(argv, inputs=[folder, other])


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
    Case(
        "fit-verdict-a-sweep-given-twice",
        "misleading",
        _a_sweep_twice,
        r"`--predict` '.*sweep/' is the folder `--predict` '.*sweep' gives already; give each sweep once",
    ),
    Case(
        "fit-verdict-out-into-another-commands-folder",
        "silent",
        lambda env: _into_another_commands_folder(env, overwrite=False),
        r"real_sweep_run holds what another command wrote \(checkpoints, results.json\), not a fit-verdict folder",
    ),
    Case(
        "fit-verdict-out-into-another-commands-folder-with-overwrite",
        "silent",
        lambda env: _into_another_commands_folder(env, overwrite=True),
        r"real_sweep_run holds what another command wrote",
    ),
]
