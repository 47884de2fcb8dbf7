"""The merge-or-compose verdict on the paired label, fitted on synthetic and real settings and scored without leaks.

Every setting, synthetic (`predict-sweep`) or real (`real-sweep`), carries the same label
(`paired_outcome`: "merge", "compose" or "either", the best merge against the best composition on the same test
items) and the same unlabelled diagnostics (`unlabelled_diagnostics` of the composition's own rollouts).

* **The rule** (`PairedRule`): two thresholds, each the single diagnostic and cut that best separates one label
  from the rest on balanced accuracy (`stats.fit_threshold`): "is composition significantly better?" and "is the
  merge?". One yes gives that label, two noes give "either", two yeses (or a diagnostic the rule reads that is
  undefined on the setting) give "undecided", which counts as wrong.
* **No leaks** (`heldout_predictions`): a setting is scored by a rule fitted without itself and without every
  setting that shares an expert with it. A real setting's experts are `(base, skill)`; a synthetic setting's are
  its family (a family's settings are built from one set of trained components), so the synthetic settings are
  held out by family, as `leave_one_family_out` does.
* **Baselines**, on the same held-out settings: "always merge", "always compose", and the majority label of the
  settings the rule for that setting was fitted on.
* **Accuracy** with its 95 % Wilson interval (scipy's `binomtest(...).proportion_ci`), on the real settings alone
  and on all settings, and the confusion table (`confusion[true][predicted]`).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict
from scipy.stats import binomtest

from mergecompose.analysis.paired_outcome import OUTCOMES
from mergecompose.analysis.predict import Threshold
from mergecompose.studies.predict.stats import fit_threshold, usable_diagnostics

UNDECIDED = "undecided"
PREDICTIONS = (*OUTCOMES, UNDECIDED)
BASELINES = ("always merge", "always compose", "majority")


@dataclass(frozen=True)
class LabelledSetting:
    """One setting: its label, its (composition − merge) accuracy gap on the test split, and its diagnostics."""

    name: str
    source: str  # "synthetic" or "real"
    experts: frozenset[str]  # what it must not share with the settings its rule is fitted on
    label: str
    gap: float
    diagnostics: Mapping[str, float | None] = field(hash=False, compare=False)


def synthetic_settings(predict: Mapping) -> list[LabelledSetting]:
    """The settings of a predict-sweep's predict.json (sweep version 2 or later: each has its `paired` label)."""
    settings = []
    for record in predict["settings"]:
        if "paired" not in record:
            raise ValueError(
                f"predict.json setting {record.get('name')!r} has no paired label: it was written by a predict-sweep "
                "before version 2; run the sweep again"
            )
        paired = record["paired"]
        gap = _mean(paired["compose_rights"]) - _mean(paired["merge_rights"])
        family = record["family"]
        settings.append(
            LabelledSetting(
                record["name"],
                "synthetic",
                frozenset({f"synthetic:{family}"}),
                paired["label"],
                gap,
                record["diagnostics"],
            )
        )
    return settings


def real_settings(results: Mapping) -> list[LabelledSetting]:
    """The settings of a real-sweep's results.json; each expert is named by its base (a registry name or a folder)
    and its skill, each setting by the base's last path part and its own name."""
    base = results.get("base")
    if not base:
        raise ValueError("real-sweep results.json has no `base`: it was written before the base was recorded; rerun it")
    settings = []
    for record in results["settings"]:
        settings.append(
            LabelledSetting(
                f"{Path(base).name}/{record['name']}",
                "real",
                frozenset(f"{base}:{skill}" for skill in record["skills"]),
                record["outcome"]["label"],
                record["compose_minus_merge"],
                record["diagnostics"],
            )
        )
    return settings


def _mean(values: Sequence) -> float:
    return sum(values) / len(values)


def usable_features(settings: Sequence[LabelledSetting]) -> list[str]:
    """The diagnostics every setting has (defined, finite) and that vary across them, in the first one's order:
    `stats.usable_diagnostics`, less those infinite somewhere (a threshold between infinities is undefined)."""
    names = usable_diagnostics([{"diagnostics": s.diagnostics} for s in settings])
    return [name for name in names if all(math.isfinite(s.diagnostics[name]) for s in settings)]


class PairedRule(BaseModel):
    """Two thresholds: `compose` predicts "composition significantly better", `merge` "the merge significantly
    better"."""

    model_config = ConfigDict(extra="forbid")

    compose: Threshold
    merge: Threshold
    n_settings: int

    def verdict(self, diagnostics: Mapping[str, float | None]) -> str:
        """ "compose", "merge", "either", or "undecided" (both say yes, or a diagnostic it reads is undefined)."""
        compose, merge = self.compose.outcome(diagnostics), self.merge.outcome(diagnostics)
        if compose is None or merge is None or (compose and merge):
            return UNDECIDED
        return "compose" if compose else "merge" if merge else "either"


def fit_paired_rule(settings: Sequence[LabelledSetting]) -> PairedRule:
    """The rule fitted on `settings` (features: `usable_features` of these settings only)."""
    if not settings:
        raise ValueError("a rule needs at least one setting to be fitted on")
    names = usable_features(settings)
    features = {name: np.array([s.diagnostics[name] for s in settings], dtype=float) for name in names}
    labels = np.array([s.label for s in settings])
    if not features:  # nothing varies: each question's answer is its training majority
        return PairedRule(
            compose=Threshold(constant=bool((labels == "compose").mean() > 0.5), training_accuracy=1.0),
            merge=Threshold(constant=bool((labels == "merge").mean() > 0.5), training_accuracy=1.0),
            n_settings=len(settings),
        )
    return PairedRule(
        compose=fit_threshold(features, labels == "compose"),
        merge=fit_threshold(features, labels == "merge"),
        n_settings=len(settings),
    )


def training_settings(scored: LabelledSetting, settings: Sequence[LabelledSetting]) -> list[LabelledSetting]:
    """The settings a rule that scores `scored` may be fitted on: those that share no expert with it."""
    return [s for s in settings if not (s.experts & scored.experts)]


def majority_label(settings: Sequence[LabelledSetting]) -> str:
    """The most common label; ties go to the first of "merge", "compose", "either"."""
    counts = Counter(s.label for s in settings)
    return max(OUTCOMES, key=lambda label: (counts[label], -OUTCOMES.index(label)))


def heldout_predictions(
    settings: Sequence[LabelledSetting], fit: Callable[[Sequence[LabelledSetting]], PairedRule] = fit_paired_rule
) -> list[dict]:
    """Per setting: the rule's verdict and each baseline's, all from the settings that share no expert with it.

    A setting with nothing left to fit on gets "undecided" from the rule and from the majority baseline.
    """
    names = [s.name for s in settings]
    if len(set(names)) != len(names):
        raise ValueError(f"setting names must be unique, got {sorted(n for n in set(names) if names.count(n) > 1)}")
    rows = []
    for scored in settings:
        train = training_settings(scored, settings)
        if any(s.experts & scored.experts for s in train):  # the rule must never see what it scores
            raise AssertionError(f"the rule for {scored.name} would be fitted on a setting sharing its experts")
        if train:
            rule = fit(train)
            predicted, majority = rule.verdict(scored.diagnostics), majority_label(train)
            reads = [rule.compose.feature, rule.merge.feature]
        else:
            predicted, majority, reads = UNDECIDED, UNDECIDED, []
        rows.append(
            {
                "name": scored.name,
                "source": scored.source,
                "label": scored.label,
                "gap": scored.gap,
                "fitted_on": len(train),
                "reads": reads,
                "predicted": predicted,
                "baselines": {"always merge": "merge", "always compose": "compose", "majority": majority},
            }
        )
    return rows


def accuracy(hits: Sequence[bool]) -> dict:
    """`{"accuracy", "ci95", "correct", "n"}`: the share of hits with its 95 % Wilson interval."""
    n, k = len(hits), int(sum(hits))
    if n == 0:
        return {"accuracy": None, "ci95": None, "correct": 0, "n": 0}
    interval = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    return {"accuracy": k / n, "ci95": [float(interval.low), float(interval.high)], "correct": k, "n": n}


def evaluate(rows: Sequence[dict]) -> dict:
    """The rule's and the baselines' held-out accuracy, and the rule's confusion table, on these rows."""
    confusion = {label: dict.fromkeys(PREDICTIONS, 0) for label in OUTCOMES}
    for row in rows:
        confusion[row["label"]][row["predicted"]] += 1
    rule = accuracy([row["predicted"] == row["label"] for row in rows])
    baselines = {name: accuracy([row["baselines"][name] == row["label"] for row in rows]) for name in BASELINES}
    beats = rule["n"] > 0 and all(rule["accuracy"] > baselines[name]["accuracy"] for name in BASELINES)
    return {
        "rule": rule,
        "baselines": baselines,
        "beats_every_baseline": beats,
        "undecided": sum(row["predicted"] == UNDECIDED for row in rows),
        "confusion": confusion,
        "labels": dict(Counter(row["label"] for row in rows)),
    }


def fit_verdict(settings: Sequence[LabelledSetting]) -> dict:
    """verdict.json's content: the held-out rows, their evaluation (real settings alone, and all), the rule fitted
    on every setting."""
    rows = heldout_predictions(settings)
    real = [row for row in rows if row["source"] == "real"]
    return {
        "n_settings": len(settings),
        "n_real": len(real),
        "heldout": {"real": evaluate(real), "all": evaluate(rows)},
        "rows": rows,
        "rule": fit_paired_rule(settings).model_dump(mode="json"),
    }


def load_settings(predict_dirs: Sequence[str | os.PathLike], real_dirs: Sequence[str | os.PathLike]) -> list:
    """The labelled settings of predict-sweep folders (predict.json) and real-sweep folders (results.json)."""
    seen: dict[Path, str] = {}
    for option, folders in (("--predict", predict_dirs), ("--real", real_dirs)):
        for folder in folders:
            where = Path(folder).expanduser().resolve()
            if where in seen:
                raise ValueError(
                    f"`{option}` {str(folder)!r} is the folder {seen[where]} gives already; give each sweep once"
                )
            seen[where] = f"`{option}` {str(folder)!r}"
    settings: list[LabelledSetting] = []
    for folder in predict_dirs:
        settings += synthetic_settings(_read_json(folder, "predict.json", "--predict"))
    for folder in real_dirs:
        settings += real_settings(_read_json(folder, "results.json", "--real"))
    if not settings:
        raise ValueError("no settings: give at least one --predict or --real folder")
    return settings


def _read_json(folder: str | os.PathLike, name: str, option: str) -> dict:
    path = Path(folder) / name
    if not path.is_file():
        raise ValueError(f"`{option}` must be a finished sweep folder holding {name}, got {str(folder)!r}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"`{option}` {str(path)!r} is not JSON: {error}") from None
