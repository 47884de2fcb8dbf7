"""Every setting's per-item right/wrong, in one compact versioned file: `docs/results/data/settings_records.json`.

The sweeps keep what each system answered in their run folders (`real-sweep`: a cell per system and split,
`OUT/settings/<setting>/cells/<system>--<split>.json`; `predict-sweep`: the chosen merge's and composition's test
rights in `predict.json`). `export_records` gathers them into one `SettingsRecords`: per setting, per system, its
right/wrong on each validation and test item as a string of '1' (right) and '0' (wrong), in item order, and the
label recomputed from them with today's `paired_outcome` (so it includes "neither"), beside the label its sweep
wrote (`previous_label`). `relabel_counts` counts the labels and the changes.

The file is JSON, one setting per line (`write_records`), read back by `load_records`, which refuses a file of
another version, a string of other characters than '0' and '1', a setting whose systems answered different numbers
of items, a chosen system without its test string, a label that its strings do not give, and a repeated name.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mergecompose.analysis.overlap_report import json_safe
from mergecompose.analysis.paired_outcome import ALPHA, FLOOR, OUTCOMES, PairedOutcome, paired_outcome
from mergecompose.core.io import atomic_write_text, read_utf8, validation_message
from mergecompose.experiments.scored_systems import merge_name

RECORDS_VERSION = 1
RECORDS_FORMAT = "mergecompose-settings-records"
# The checked-in file, relative to the checkout's root (for commands run from the checkout; the package, once
# installed, does not know where a checkout is, so `load_records` takes a path).
RECORDS_FILE = "docs/results/data/settings_records.json"
SPLITS = ("validation", "test")


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def rights_string(rights: Iterable[bool]) -> str:
    """Right/wrong per item as '1'/'0' characters, in item order."""
    values = list(rights)
    if not all(isinstance(value, bool) for value in values):
        raise ValueError(f"rights must be bools, one per item, got {values!r:.80}")
    return "".join("1" if value else "0" for value in values)


class SystemRecord(_Record):
    """One system's right ('1') or wrong ('0') on each item of a split, in item order; None: not kept."""

    validation: str | None = None
    test: str | None = None

    @field_validator("validation", "test")
    @classmethod
    def _zeros_and_ones(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value:
            raise ValueError("must hold one '0' or '1' per item, got an empty string")
        bad = next((index for index, char in enumerate(value) if char not in "01"), None)
        if bad is not None:
            raise ValueError(f"must hold only '0' and '1', got {value[bad]!r} at item {bad}")
        return value


class ChosenSystems(_Record):
    """The best merge and the best composition, chosen on the validation items: names in `systems`."""

    merge: str
    compose: str


class SettingRecord(_Record):
    """One setting: its systems' per-item rights, its diagnostics and its label."""

    name: str = Field(min_length=1)
    source: Literal["real", "synthetic"]
    base: str  # real: the base (a registry name or a folder); synthetic: "synthetic:<family>"
    family: str | None = None  # synthetic: the predict-sweep family
    # What says which settings share an expert: real "<base>:<skill>", synthetic "synthetic:<family>".
    experts: list[str] = Field(min_length=1)
    diagnostics: dict[str, float | None]
    chosen: ChosenSystems
    systems: dict[str, SystemRecord]
    label: Literal["merge", "compose", "either", "neither"]  # paired_outcome of the chosen systems' test rights
    previous_label: str | None = None  # the label the sweep wrote
    sweep: str  # the sweep's name
    config_hash: str

    @field_validator("diagnostics")
    @classmethod
    def _nan_is_undefined(cls, diagnostics: dict[str, float | None]) -> dict[str, float | None]:
        return {name: None if value is None or math.isnan(value) else value for name, value in diagnostics.items()}

    @model_validator(mode="after")
    def _consistent(self) -> SettingRecord:
        for split in SPLITS:
            lengths = {name: len(s) for name, system in self.systems.items() if (s := getattr(system, split))}
            if len(set(lengths.values())) > 1:
                raise ValueError(
                    f"setting {self.name!r}: its systems' `{split}` strings must have one length (the same items), "
                    f"got {lengths}"
                )
        for kind, system in (("merge", self.chosen.merge), ("compose", self.chosen.compose)):
            if system not in self.systems or self.systems[system].test is None:
                raise ValueError(
                    f"setting {self.name!r}: `chosen.{kind}` {system!r} must have its `test` string in `systems` "
                    f"(systems with one: {[n for n, s in self.systems.items() if s.test is not None]})"
                )
        return self

    def rights(self, system: str, split: str) -> list[bool]:
        """`system`'s right/wrong on each item of `split` ("validation" or "test"), in item order."""
        if split not in SPLITS:
            raise ValueError(f"`split` must be one of {SPLITS}, got {split!r}")
        if system not in self.systems:
            raise ValueError(f"setting {self.name!r} has no system {system!r}; it has {sorted(self.systems)}")
        text = getattr(self.systems[system], split)
        if text is None:
            raise ValueError(f"setting {self.name!r}: system {system!r} has no `{split}` rights kept")
        return [char == "1" for char in text]

    @property
    def merge_test(self) -> list[bool]:
        """The chosen merge's right/wrong on the test items."""
        return self.rights(self.chosen.merge, "test")

    @property
    def compose_test(self) -> list[bool]:
        """The chosen composition's right/wrong on the test items."""
        return self.rights(self.chosen.compose, "test")

    def outcome(self, alpha: float = ALPHA, floor: float = FLOOR) -> PairedOutcome:
        """`paired_outcome` of the chosen merge against the chosen composition on the test items."""
        return paired_outcome(self.merge_test, self.compose_test, alpha, floor)


class Made(_Record):
    commit: str  # the checkout's commit that exported the file ("+changes": with uncommitted changes)
    cpu: str  # torch.backends.cpu.get_cpu_capability()
    date: str  # UTC, ISO 8601


class SweepSource(_Record):
    name: str
    config_hash: str
    kind: Literal["real-sweep", "predict-sweep"]


class SettingsRecords(_Record):
    """The whole file: how it was made, the sweeps it came from, and every setting (module docstring)."""

    format: Literal["mergecompose-settings-records"] = RECORDS_FORMAT
    version: int = RECORDS_VERSION
    floor: float = FLOOR
    alpha: float = ALPHA
    made: Made
    sweeps: list[SweepSource]
    settings: list[SettingRecord] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _this_version(cls, data: object) -> object:
        # Before the fields: a file of another version gets this message alone, not its fields' differences.
        if isinstance(data, Mapping) and "version" in data and data["version"] != RECORDS_VERSION:
            raise ValueError(
                f"`version` {data['version']!r} is not one this code reads (version {RECORDS_VERSION}); "
                "export the file again with `mergecompose export-records`"
            )
        return data

    @model_validator(mode="after")
    def _names_and_labels(self) -> SettingsRecords:
        seen: set[str] = set()
        for setting in self.settings:
            if setting.name in seen:
                raise ValueError(f"`settings` must not repeat a name, got {setting.name!r} twice")
            seen.add(setting.name)
            label = setting.outcome(self.alpha, self.floor).label
            if setting.label != label:
                raise ValueError(
                    f"setting {setting.name!r}: `label` {setting.label!r} is not what its chosen systems' test "
                    f"strings give ({label!r} at alpha {self.alpha}, floor {self.floor})"
                )
        return self


# ---- export from finished sweep folders ----------------------------------------------------------------------


def export_records(
    real: Iterable[str | os.PathLike] = (),
    predict: Iterable[str | os.PathLike] = (),
    alpha: float = ALPHA,
    floor: float = FLOOR,
    keep: SettingsRecords | None = None,
) -> SettingsRecords:
    """The records of finished real-sweep folders (results.json and their cells) and predict-sweep folders
    (predict.json). A setting name found in two sweeps is prefixed by its sweep's name (`<sweep>/<name>`).

    `keep`: an earlier records file whose sweeps and settings are kept, but for the sweeps read again here (same
    name): so a file grows by a new sweep without the folders of the sweeps it already holds. Its `alpha` and
    `floor` must be these."""
    sweeps: list[SweepSource] = []
    settings: list[SettingRecord] = []
    if keep is not None and (keep.alpha, keep.floor) != (alpha, floor):
        raise ValueError(
            f"`keep`'s records were labelled at alpha {keep.alpha}, floor {keep.floor}; these are labelled at "
            f"alpha {alpha}, floor {floor}: export them all again from their sweeps"
        )
    for folder in real:
        results = _read_json(Path(folder) / "results.json", "--real", folder)
        sweeps.append(SweepSource(name=results["name"], config_hash=results["config_hash"], kind="real-sweep"))
        settings += [_real_setting(results, record, Path(folder), alpha, floor) for record in results["settings"]]
    for folder in predict:
        results = _read_json(Path(folder) / "predict.json", "--predict", folder)
        sweeps.append(SweepSource(name=results["name"], config_hash=results["config_hash"], kind="predict-sweep"))
        settings += [_synthetic_setting(results, record, alpha, floor) for record in results["settings"]]
    if not sweeps:
        raise ValueError("no sweeps: give at least one real-sweep folder (--real) or predict-sweep folder (--predict)")
    if keep is not None:
        again = {sweep.name for sweep in sweeps}
        sweeps = [sweep for sweep in keep.sweeps if sweep.name not in again] + sweeps
        settings = [setting for setting in keep.settings if setting.sweep not in again] + settings
    counts = Counter(setting.name for setting in settings)
    settings = [
        setting.model_copy(update={"name": f"{setting.sweep}/{setting.name}"}) if counts[setting.name] > 1 else setting
        for setting in settings
    ]
    made = Made(commit=_commit(), cpu=torch.backends.cpu.get_cpu_capability(), date=_now())
    return SettingsRecords(floor=floor, alpha=alpha, made=made, sweeps=sweeps, settings=settings)


def _real_setting(results: Mapping, record: Mapping, folder: Path, alpha: float, floor: float) -> SettingRecord:
    """One setting of a real-sweep's results.json, its rights read from its cells."""
    base, name = results["base"], record["name"]
    cells = folder / "settings" / name / "cells"
    chosen = record["chosen"]
    wanted = {
        "validation": {**chosen["merge"]["validation"], **chosen["compose"]["validation"]},
        "test": {system: scores["accuracy"] for system, scores in record["test"].items()},
    }
    strings: dict[str, dict[str, str]] = {}
    for split, accuracies in wanted.items():
        for system, accuracy in accuracies.items():
            path = cells / f"{system}--{split}.json"
            cell = _read_json(path, "--real", folder)
            rights = cell["right"]
            if cell.get("system") != system or cell.get("split") != split or not rights:
                raise ValueError(f"`--real` cell {str(path)!r} is not {system!r} on {split!r} items")
            if not math.isclose(sum(rights) / len(rights), accuracy, rel_tol=0, abs_tol=1e-12):
                raise ValueError(
                    f"`--real` cell {str(path)!r} scores {sum(rights) / len(rights)}, and results.json says "
                    f"{accuracy}: the cell is not the one the sweep used"
                )
            strings.setdefault(system, {})[split] = rights_string(rights)
    merge, compose = chosen["merge"]["system"], chosen["compose"]["system"]
    outcome = paired_outcome(
        [c == "1" for c in strings[merge]["test"]], [c == "1" for c in strings[compose]["test"]], alpha, floor
    )
    return SettingRecord(
        name=name,
        source="real",
        base=base,
        family=None,
        experts=[f"{base}:{skill}" for skill in record["skills"]],
        diagnostics=record["diagnostics"],
        chosen=ChosenSystems(merge=merge, compose=compose),
        systems={system: SystemRecord(**split_strings) for system, split_strings in strings.items()},
        label=outcome.label,
        previous_label=record.get("outcome", {}).get("label"),
        sweep=results["name"],
        config_hash=results["config_hash"],
    )


def _synthetic_setting(results: Mapping, record: Mapping, alpha: float, floor: float) -> SettingRecord:
    """One setting of a predict-sweep's predict.json: the chosen merge's and composition's test rights."""
    if "paired" not in record:
        raise ValueError(
            f"`--predict` predict.json setting {record.get('name')!r} has no paired label: it was written by a "
            "predict-sweep before version 2; run the sweep again"
        )
    paired, family = record["paired"], record["family"]
    params = {k: v for k, v in record["merge_chosen"].items() if k not in ("method", "validation")}
    merge, compose = merge_name(record["merge_chosen"]["method"], params), paired["composition"]
    outcome = paired_outcome(paired["merge_rights"], paired["compose_rights"], alpha, floor)
    return SettingRecord(
        name=record["name"],
        source="synthetic",
        base=f"synthetic:{family}",
        family=family,
        experts=[f"synthetic:{family}"],
        diagnostics=record["diagnostics"],
        chosen=ChosenSystems(merge=merge, compose=compose),
        systems={
            merge: SystemRecord(test=rights_string(paired["merge_rights"])),
            compose: SystemRecord(test=rights_string(paired["compose_rights"])),
        },
        label=outcome.label,
        previous_label=paired.get("label"),
        sweep=results["name"],
        config_hash=results["config_hash"],
    )


def _read_json(path: Path, option: str, folder: str | os.PathLike) -> dict:
    if not path.is_file():
        raise ValueError(f"`{option}` {str(folder)!r} is not a finished sweep folder: it has no {str(path)!r}")
    try:
        return json.loads(read_utf8(path, f"{option} {path.name}"))
    except json.JSONDecodeError as error:
        raise ValueError(f"`{option}` {str(path)!r} is not JSON: {error}") from None


def _commit() -> str:
    """The checkout's short commit, "+changes" with uncommitted changes; "unknown" outside a git checkout."""

    def git(*arguments: str) -> str:
        where = Path(__file__).resolve().parent
        return subprocess.run(["git", *arguments], capture_output=True, text=True, check=True, cwd=where).stdout.strip()

    try:
        commit, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+changes" if dirty else "")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ---- the file --------------------------------------------------------------------------------------------------


def records_text(records: SettingsRecords) -> str:
    """The file's text: JSON, the header on the first line, then one setting per line (small diffs).
    ±inf diagnostics are written as the strings "inf" / "-inf" (`json_safe`), which load back as floats."""
    header = json.dumps(json_safe(records.model_dump(exclude={"settings"})), allow_nan=False)
    settings = [json.dumps(json_safe(setting.model_dump()), allow_nan=False) for setting in records.settings]
    return header[:-1] + ', "settings": [\n' + ",\n".join(settings) + "\n]}\n"


def write_records(records: SettingsRecords, path: str | os.PathLike) -> None:
    """Write `records` to `path` atomically (`records_text`), creating its folder."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, records_text(records))


def load_records(path: str | os.PathLike) -> SettingsRecords:
    """The records of the file `path`, read through the loading boundary and validated; a file that is not UTF-8,
    not JSON or not this schema (or of another version) is refused in one ValueError naming it."""
    text = read_utf8(path, "records")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(path)!r} is not a settings-records file: not JSON: {error}") from None
    try:
        return SettingsRecords.model_validate(data)
    except ValidationError as error:
        raise ValueError(f"{str(path)!r} is not a valid settings-records file: {validation_message(error)}") from None


# ---- the recount -----------------------------------------------------------------------------------------------


def relabel_counts(records: SettingsRecords) -> dict:
    """Per source ("real", "synthetic", "all"): `settings`, `labels` (each new label's count, every outcome
    listed), `changed` (settings whose label differs from their sweep's) and `crosstab[previous][new]` (a previous
    label of None as "none")."""
    counts = {}
    for source in ("real", "synthetic", "all"):
        chosen = [s for s in records.settings if source in ("all", s.source)]
        crosstab: dict[str, dict[str, int]] = {}
        for setting in chosen:
            row = crosstab.setdefault(setting.previous_label or "none", dict.fromkeys(OUTCOMES, 0))
            row[setting.label] += 1
        counts[source] = {
            "settings": len(chosen),
            "labels": {label: sum(s.label == label for s in chosen) for label in OUTCOMES},
            "changed": sum(s.label != s.previous_label for s in chosen),
            "crosstab": crosstab,
        }
    return counts
