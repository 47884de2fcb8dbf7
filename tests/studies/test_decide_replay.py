"""The sequential rule replayed over a records file: per setting and per source, agreement with the full-n label,
wrong decisions by their definition, and the share of items used; the command writes replay.json and replay.md."""

from __future__ import annotations

import json

import pytest

from mergecompose.analysis.paired_outcome import paired_outcome
from mergecompose.analysis.sequential_decision import replay_orders
from mergecompose.cli import main
from mergecompose.studies.decide.replay import is_wrong, replay_records
from mergecompose.studies.predict.records import (
    ChosenSystems,
    Made,
    SettingRecord,
    SettingsRecords,
    SweepSource,
    SystemRecord,
    rights_string,
    write_records,
)


def setting(name: str, source: str, merge: list[bool], compose: list[bool]) -> SettingRecord:
    return SettingRecord(
        name=name,
        source=source,
        base="b",
        family=None,
        experts=[f"b:{name}"],
        diagnostics={},
        chosen=ChosenSystems(merge="m", compose="c"),
        systems={"m": SystemRecord(test=rights_string(merge)), "c": SystemRecord(test=rights_string(compose))},
        label=paired_outcome(merge, compose).label,
        previous_label=None,
        sweep="s",
        config_hash="h",
    )


@pytest.fixture(scope="module")
def records() -> SettingsRecords:
    wins = setting("compose wins", "real", [False] * 150, [i % 2 == 0 for i in range(150)])  # 0 % vs 50 %
    zeros = setting("both fail", "real", [False] * 150, [False] * 150)
    ties = setting("both work", "synthetic", [True] * 200, [True] * 200)
    return SettingsRecords(
        made=Made(commit="c", cpu="AVX512", date="d"),
        sweeps=[SweepSource(name="s", config_hash="h", kind="real-sweep")],
        settings=[wins, zeros, ties],
    )


def test_each_setting_is_its_orders_replayed(records):
    results = replay_records(records, orders=6, seed=3)
    for index, (row, record) in enumerate(zip(results["settings"], records.settings)):
        decisions = replay_orders(record.merge_test, record.compose_test, 6, 3 * 100_003 + index)
        assert row["labels"] == {label: [d.label for d in decisions].count(label) for label in row["labels"]}
        assert row["share_used"] == pytest.approx(sum(d.items for d in decisions) / 6 / row["items"])
        assert row["agreement"] == sum(d.label == record.label for d in decisions) / 6
    assert [row["full_label"] for row in results["settings"]] == ["compose", "neither", "either"]
    assert results["summary"]["real"]["settings"] == 2 and results["summary"]["all"]["settings"] == 3
    assert results["summary"]["all"]["agreement"] == pytest.approx(
        sum(row["agreement"] for row in results["settings"]) / 3
    )


def test_what_counts_as_wrong():
    assert is_wrong("merge", "compose", 0.2, 0.5, 0.1) and is_wrong("compose", "merge", 0.5, 0.2, 0.1)
    assert is_wrong("neither", "either", 0.12, 0.0, 0.1)  # a side reaches the floor
    assert not is_wrong("neither", "neither", 0.05, 0.08, 0.1)
    assert not is_wrong("either", "compose", 0.4, 0.5, 0.1)  # a disagreement, not an error the rule bounds


def test_the_command_writes_its_files(records, tmp_path):
    path = tmp_path / "records.json"
    write_records(records, path)
    assert (
        main(["decide-replay", "--records", str(path), "--orders", "3", "--out", str(tmp_path / "r"), "--quiet"]) == 0
    )
    results = json.loads((tmp_path / "r" / "replay.json").read_text())
    assert results["orders"] == 3 and len(results["settings"]) == 3
    assert "# The sequential rule, replayed" in (tmp_path / "r" / "replay.md").read_text()
