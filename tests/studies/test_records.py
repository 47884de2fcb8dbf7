"""The settings records: exported from sweep folders laid out as the sweeps write them (by hand here: a real sweep
takes minutes, and the layout is what the exporter reads), written and loaded back, labels recomputed, bad files
refused, and `mergecompose export-records`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mergecompose.analysis.paired_outcome import paired_outcome
from mergecompose.analysis.predict import load_rule
from mergecompose.analysis.real_settings_score import score_on_real_settings
from mergecompose.cli import main
from mergecompose.studies.predict.records import (
    RECORDS_FILE,
    RECORDS_VERSION,
    SettingsRecords,
    export_records,
    load_records,
    records_text,
    relabel_counts,
    write_records,
)
from mergecompose.studies.predict.records_command import real_settings_of

MERGES = ["merge:task_arithmetic@lam=1", "merge:ties@lam=1,density=0.5"]
COMPOSITIONS = ["compose@1", "compose+gate"]


def rights(pattern: str) -> list[bool]:
    return [char == "1" for char in pattern]


def write_cell(folder: Path, system: str, split: str, pattern: str) -> None:
    right = rights(pattern)
    cell = {
        "system": system,
        "split": split,
        "prompts": [f"prompt {i}" for i in range(len(right))],
        "outputs": ["answer"] * len(right),
        "right": right,
        "strict": right,
        "parts": {},
        "accuracy": sum(right) / len(right),
    }
    path = folder / "cells" / f"{system}--{split}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cell) + "\n")


def real_setting(folder: Path, skills: list[str], merge_test: str, compose_test: str, label: str) -> dict:
    """One setting of results.json, its cells written under `folder/settings/<name>/cells`: 4 validation items
    (the second merge and the first composition score best), 20 test items."""
    name = "+".join(skills)
    setting_folder = folder / "settings" / name
    validation = {MERGES[0]: "1000", MERGES[1]: "1100", COMPOSITIONS[0]: "1110", COMPOSITIONS[1]: "1100"}
    for system, pattern in validation.items():
        write_cell(setting_folder, system, "validation", pattern)
    test = {
        "base": "0" * 20,
        f"expert:{skills[0]}": "01" * 10,
        f"expert:{skills[1]}": "0011" * 5,
        MERGES[1]: merge_test,
        COMPOSITIONS[0]: compose_test,
    }
    for system, pattern in test.items():
        write_cell(setting_folder, system, "test", pattern)
    score = {
        split: {s: sum(rights(p)) / len(p) for s, p in patterns.items()}
        for split, patterns in (("validation", validation), ("test", test))
    }
    return {
        "name": name,
        "skills": skills,
        "chosen": {
            "merge": {"system": MERGES[1], "validation": {m: score["validation"][m] for m in MERGES}},
            "compose": {"system": COMPOSITIONS[0], "validation": {c: score["validation"][c] for c in COMPOSITIONS}},
        },
        "test": {s: {"accuracy": a, "strict_accuracy": a, "parts": {}} for s, a in score["test"].items()},
        "outcome": {"label": label},
        "diagnostics": {"merge_compose_kl": 0.25, "top1_shift_rate_mean": None},
        "compose_minus_merge": score["test"][COMPOSITIONS[0]] - score["test"][MERGES[1]],
        "seconds": 1.0,
        "cell_seconds": 1.0,
    }


def real_sweep(folder: Path, name: str, base: str, settings: list[tuple]) -> Path:
    folder.mkdir(parents=True)
    records = [real_setting(folder, *setting) for setting in settings]
    results = {"name": name, "config_hash": f"hash-{name}", "base": base, "settings": records}
    (folder / "results.json").write_text(json.dumps(results, indent=1))
    return folder


def predict_sweep(folder: Path) -> Path:
    folder.mkdir(parents=True)
    settings = []
    for name, family, merge, compose, label in [
        ("pair_ab", "letters", "1" * 15 + "0" * 5, "1" * 5 + "0" * 15, "merge"),
        ("pair_cd", "skills", "0" * 20, "1" + "0" * 19, "either"),  # neither reaches 10 %: now "neither"
    ]:
        settings.append(
            {
                "name": name,
                "family": family,
                "experts": ["a", "b"],
                "diagnostics": {"merge_compose_kl": "inf", "top1_shift_rate_mean": 0.5},
                "outcomes": {"compose": 0.5},
                "merge_chosen": {"method": "ties", "lam": 1.0, "density": 0.5, "validation": 0.4},
                "paired": {
                    "composition": "gate",
                    "composition_validation": {"compose": 0.3, "gate": 0.4},
                    "label": label,
                    "merge_rights": rights(merge),
                    "compose_rights": rights(compose),
                },
            }
        )
    (folder / "predict.json").write_text(json.dumps({"name": "predict", "config_hash": "hash-p", "settings": settings}))
    return folder


@pytest.fixture
def sweeps(tmp_path) -> dict[str, Path]:
    either = ("1" * 10 + "0" * 10, "1" * 12 + "0" * 8)
    compose = ("0" * 20, "1" * 15 + "0" * 5)
    neither = ("0" * 20, "1" + "0" * 19)
    return {
        "smollm2": real_sweep(
            tmp_path / "real_settings",
            "real_settings",
            "smollm2-135m-instruct",
            [(["units", "json"], *either, "either"), (["dates", "caps"], *compose, "compose")],
        ),
        "gemma": real_sweep(
            tmp_path / "real_settings_gemma",
            "real_settings_gemma",
            "gemma-3-270m",
            [(["units", "json"], *neither, "either")],
        ),
        "predict": predict_sweep(tmp_path / "predict"),
    }


@pytest.fixture
def records(sweeps) -> SettingsRecords:
    return export_records([sweeps["smollm2"], sweeps["gemma"]], [sweeps["predict"]])


def test_export_reads_every_system_and_recomputes_each_label(records):
    by_name = {setting.name: setting for setting in records.settings}
    # "units+json" is in both real sweeps: prefixed by each sweep's name; the others keep theirs.
    assert sorted(by_name) == [
        "dates+caps",
        "pair_ab",
        "pair_cd",
        "real_settings/units+json",
        "real_settings_gemma/units+json",
    ]
    units = by_name["real_settings/units+json"]
    assert units.experts == ["smollm2-135m-instruct:units", "smollm2-135m-instruct:json"]
    assert units.chosen.merge == MERGES[1] and units.chosen.compose == COMPOSITIONS[0]
    assert sorted(units.systems) == sorted(
        ["base", "expert:units", "expert:json", *MERGES, *COMPOSITIONS]
    )  # every validation candidate and every test system
    assert units.systems[MERGES[0]].validation == "1000" and units.systems[MERGES[0]].test is None
    assert units.systems[MERGES[1]].validation == "1100" and units.systems[MERGES[1]].test == "1" * 10 + "0" * 10
    assert units.rights("expert:json", "test") == rights("0011" * 5)
    assert units.diagnostics == {"merge_compose_kl": 0.25, "top1_shift_rate_mean": None}
    with pytest.raises(ValueError, match=r"no `test` rights kept"):
        units.rights(MERGES[0], "test")
    with pytest.raises(ValueError, match=r"has no system 'compose@2'; it has \['base'"):
        units.rights("compose@2", "test")
    synthetic = by_name["pair_ab"]
    assert synthetic.source == "synthetic" and synthetic.family == "letters"
    assert synthetic.experts == ["synthetic:letters"] and synthetic.base == "synthetic:letters"
    assert synthetic.chosen.merge == "merge:ties@lam=1.0,density=0.5" and synthetic.chosen.compose == "gate"
    assert synthetic.systems["gate"].validation is None
    assert synthetic.diagnostics["merge_compose_kl"] == float("inf")
    for setting in records.settings:
        assert setting.label == paired_outcome(setting.merge_test, setting.compose_test).label
        assert setting.outcome() == paired_outcome(setting.merge_test, setting.compose_test)
    labels = {name: (s.previous_label, s.label) for name, s in by_name.items()}
    assert labels == {
        "real_settings/units+json": ("either", "either"),
        "dates+caps": ("compose", "compose"),
        "real_settings_gemma/units+json": ("either", "neither"),
        "pair_ab": ("merge", "merge"),
        "pair_cd": ("either", "neither"),
    }
    assert [(s.name, s.kind) for s in records.sweeps] == [
        ("real_settings", "real-sweep"),
        ("real_settings_gemma", "real-sweep"),
        ("predict", "predict-sweep"),
    ]


def test_relabel_counts(records):
    counts = relabel_counts(records)
    assert counts["real"]["labels"] == {"merge": 0, "compose": 1, "either": 1, "neither": 1}
    assert counts["synthetic"]["labels"] == {"merge": 1, "compose": 0, "either": 0, "neither": 1}
    assert counts["all"]["settings"] == 5 and counts["all"]["changed"] == 2
    assert counts["all"]["crosstab"]["either"] == {"merge": 0, "compose": 0, "either": 1, "neither": 2}


def test_write_and_load_round_trip(records, tmp_path):
    path = tmp_path / "records.json"
    write_records(records, path)
    loaded = load_records(path)
    assert loaded == records
    lines = path.read_text().splitlines()
    assert len(lines) == 1 + len(records.settings) + 1  # the header, one line per setting, the closing brackets
    assert '"inf"' in path.read_text()  # ±inf as strings: the file is strict JSON
    json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))


def _data(records: SettingsRecords) -> dict:
    return json.loads(records_text(records))


def _broken(records, tmp_path, change) -> Path:
    data = _data(records)
    change(data)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    return path


def _set_test(data, setting, system, value):
    data["settings"][setting]["systems"][system]["test"] = value


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda d: _set_test(d, 0, "base", "0" * 19 + "x"),
            r"systems\.base\.test: .*only '0' and '1', got 'x' at item 19",
        ),
        (lambda d: _set_test(d, 0, "base", "0" * 19), r"`test` strings must have one length.*'base': 19"),
        (
            lambda d: d.update(version=RECORDS_VERSION + 1),
            rf"`version` {RECORDS_VERSION + 1} is not one this code reads",
        ),
        (lambda d: d["settings"][0]["systems"].pop(MERGES[1]), r"`chosen.merge` .* must have its `test` string"),
        (lambda d: d["settings"][1].update(name=d["settings"][0]["name"]), r"must not repeat a name"),
        (lambda d: d["settings"][0].update(label="merge"), r"`label` 'merge' is not what .* give \('either'"),
        (lambda d: d.update(format="something else"), r"format"),
        (lambda d: d.update(extra=1), r"extra"),
    ],
    ids=["bad character", "unequal lengths", "version", "chosen without test", "duplicate", "label", "format", "extra"],
)
def test_a_bad_file_is_refused_naming_the_problem(records, tmp_path, change, message):
    path = _broken(records, tmp_path, change)
    with pytest.raises(ValueError, match=message) as error:
        load_records(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_a_file_that_is_not_json_is_refused(tmp_path):
    path = tmp_path / "records.json"
    path.write_text('{"format": "mergecompose-settings-records", ')
    with pytest.raises(ValueError, match="not JSON") as error:
        load_records(path)
    assert str(path) in str(error.value)


def test_a_folder_without_its_results_is_refused(sweeps, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"`--real` .*empty.* is not a finished sweep folder: .*results\.json"):
        export_records([tmp_path / "empty"], [])
    with pytest.raises(
        ValueError, match=r"`--predict` .*real_settings.* is not a finished sweep folder: .*predict\.json"
    ):
        export_records([], [sweeps["smollm2"]])  # a real-sweep folder given as a predict-sweep's


def test_a_cell_that_is_not_the_one_the_sweep_used_is_refused(sweeps):
    cell = sweeps["gemma"] / "settings" / "units+json" / "cells" / f"{COMPOSITIONS[0]}--test.json"
    data = json.loads(cell.read_text())
    data["right"][-1] = True  # a rerun with other items would score otherwise
    cell.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="is not the one the sweep used"):
        export_records([sweeps["gemma"]], [])


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("mergecompose export-records: error: "), err
    return err


def test_the_command_writes_the_file_and_prints_the_recount(sweeps, tmp_path, capsys):
    out = tmp_path / "data" / "settings_records.json"
    arguments = ["export-records", "--real", str(sweeps["smollm2"]), "--real", str(sweeps["gemma"])]
    arguments += ["--predict", str(sweeps["predict"]), "--out", str(out)]
    assert main(arguments) == 0
    printed = capsys.readouterr().out
    assert "| real " in printed and "| all " in printed and "neither" in printed
    assert load_records(out) == export_records([sweeps["smollm2"], sweeps["gemma"]], [sweeps["predict"]]).model_copy(
        update={"made": load_records(out).made}
    )
    # Again: refused without --overwrite, the file unchanged; with it, replaced.
    before = out.read_text()
    assert main(arguments) == 2
    assert "exists; give --overwrite" in one_error_line(capsys)
    assert out.read_text() == before
    assert main([*arguments, "--overwrite", "--quiet"]) == 0


def test_keep_adds_a_sweep_to_an_earlier_file_without_its_folders(sweeps, tmp_path, capsys):
    first = tmp_path / "first.json"
    assert (
        main(
            [
                "export-records",
                "--real",
                str(sweeps["smollm2"]),
                "--predict",
                str(sweeps["predict"]),
                "--out",
                str(first),
                "--quiet",
            ]
        )
        == 0
    )
    capsys.readouterr()
    grown = tmp_path / "grown.json"
    assert main(["export-records", "--keep", str(first), "--real", str(sweeps["gemma"]), "--out", str(grown)]) == 0
    capsys.readouterr()
    together = export_records([sweeps["smollm2"], sweeps["gemma"]], [sweeps["predict"]])
    kept = load_records(grown)
    # The same settings as one export of all three folders (the clash of names prefixed alike), in the kept
    # file's order then the new sweep's.
    assert {s.name: s for s in kept.settings} == {s.name: s for s in together.settings}
    assert [s.name for s in kept.sweeps] == ["real_settings", "predict", "real_settings_gemma"]
    # A sweep given again replaces its kept settings rather than adding them twice.
    again = export_records([sweeps["smollm2"]], keep=load_records(first))
    assert sorted(s.name for s in again.settings) == sorted(s.name for s in load_records(first).settings)
    with pytest.raises(ValueError, match="labelled at alpha 0.05, floor 0.1; these are labelled at alpha 0.01"):
        export_records([sweeps["gemma"]], alpha=0.01, keep=load_records(first))


def test_the_command_refuses_bad_folders_and_outputs_in_one_line(sweeps, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    out = str(tmp_path / "records.json")
    assert main(["export-records", "--real", str(tmp_path / "empty"), "--out", out]) == 2
    assert "results.json" in one_error_line(capsys)
    inside = str(sweeps["predict"] / "records.json")  # writing into an input folder
    assert main(["export-records", "--predict", str(sweeps["predict"]), "--out", inside]) == 2
    assert "lies inside the input" in one_error_line(capsys)
    predict_json = str(sweeps["predict"] / "predict.json")
    assert main(["export-records", "--predict", predict_json, "--out", predict_json, "--overwrite"]) == 2
    one_error_line(capsys)
    assert json.loads(Path(predict_json).read_text())["name"] == "predict"  # the input is unchanged
    assert main(["export-records", "--out", out]) == 2
    assert "give at least one" in one_error_line(capsys)


def test_the_shipped_rule_s_figures_are_the_committed_records_scored():
    """`analysis/predict_rule.json`'s `real_settings` is what `score-rule` computes from the committed records file."""
    records = load_records(Path(__file__).resolve().parents[2] / RECORDS_FILE)
    shipped = load_rule()
    assert shipped.real_settings is not None
    unscored = shipped.model_copy(update={"real_settings": None})
    expected = score_on_real_settings(unscored, real_settings_of(records), shipped.real_settings.source)
    assert shipped.real_settings == expected
    assert expected.n == sum(setting.source == "real" for setting in records.settings)
