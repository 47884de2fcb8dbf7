"""The four-label rule refitted on a records file and scored held out on its real settings, against the constants.

* **Fitting** (`fit_label_rule`): for every usable diagnostic and every pair of them, scikit-learn's
  `DecisionTreeClassifier(max_depth=2, random_state=0)` (Gini) on those columns; the tree with the highest
  training accuracy is kept, ties going to one diagnostic over two, then to the earlier names. It is written out as
  a `LabelRule` (cuts and leaves, read without scikit-learn), whose `fallback` is the training settings' majority
  label. Usable: defined (not None, finite) on every training setting and not constant there.
* **No leaks** (`heldout_rows`): a real setting is scored by a rule fitted only on the settings that share no expert
  with it (a real setting's experts are `<base>:<skill>`; a synthetic one's its family), as `fit-verdict` does.
  `train="real"` fits on real settings only, `train="all"` on the synthetic ones as well.
* **Against the constants**, on the same held-out real settings: always "merge", "compose", "either", "neither",
  and the majority label of each setting's own training settings. Accuracy with the 95 % Wilson interval.
* **What tracks what** (`tracking`): per kind of real setting (`pair_kind` of its two skills) and over all real
  settings, each diagnostic's Spearman ρ, with a bootstrap 95 % interval (`stats.correlation_with_interval`), with
  the composition's lead (compose − merge test accuracy) and with "the merge wins" (label "merge", 1 or 0).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from sklearn.tree import DecisionTreeClassifier

from mergecompose.analysis.label_rule import Cut, LabelRule, Leaf
from mergecompose.analysis.paired_outcome import OUTCOMES
from mergecompose.studies.predict.paired_verdict import accuracy, usable_features
from mergecompose.studies.predict.records import SettingRecord
from mergecompose.studies.predict.stats import correlation_with_interval
from mergecompose.studies.skill_pairs.skill_data import pair_kind

CONSTANTS = tuple(f"always {label}" for label in OUTCOMES)
BASELINES = (*CONSTANTS, "majority")
TRAIN_SETS = ("all", "real")
TARGET_ACCURACY, TARGET_MARGIN = 0.8, 0.15  # the target: >= 80 % held out, >= 15 points over every constant


def majority(labels: Iterable[str]) -> str:
    """The most common label; ties go to the first in `OUTCOMES` ("merge", "compose", "either", "neither")."""
    counts = Counter(labels)
    return max(OUTCOMES, key=lambda label: (counts[label], -OUTCOMES.index(label)))


def _node(tree, index: int, names: Sequence[str], classes: Sequence[str]) -> Cut | Leaf:
    """scikit-learn's node `index` as a `Cut` or a `Leaf` (its class of highest weight, ties to the first)."""
    left, right = tree.children_left[index], tree.children_right[index]
    if left == right:  # a leaf: scikit-learn marks both children -1
        return Leaf(label=classes[int(np.argmax(tree.value[index][0]))])
    return Cut(
        feature=names[tree.feature[index]],
        threshold=float(tree.threshold[index]),
        below=_node(tree, left, names, classes),
        above=_node(tree, right, names, classes),
    )


def tree_rule(settings: Sequence[SettingRecord], names: Sequence[str]) -> tuple[LabelRule, DecisionTreeClassifier]:
    """The depth-2 tree on the columns `names` of `settings`, as a `LabelRule`, and the fitted scikit-learn tree."""
    columns = np.array([[s.diagnostics[name] for name in names] for s in settings], dtype=float)
    labels = [s.label for s in settings]
    tree = DecisionTreeClassifier(max_depth=2, random_state=0).fit(columns, labels)
    hits = np.mean(tree.predict(columns) == np.array(labels))
    rule = LabelRule(
        root=_node(tree.tree_, 0, names, list(tree.classes_)),
        fallback=majority(labels),
        n_settings=len(settings),
        training_accuracy=float(hits),
    )
    return rule, tree


def fit_label_rule(settings: Sequence[SettingRecord]) -> LabelRule:
    """The best of the trees on one usable diagnostic or two (see the module's docstring); with no usable
    diagnostic, a single leaf: the majority label."""
    if not settings:
        raise ValueError("a rule needs at least one setting to be fitted on, got none")
    names = usable_features(settings)
    label = majority(s.label for s in settings)
    best = LabelRule(
        root=Leaf(label=label),
        fallback=label,
        n_settings=len(settings),
        training_accuracy=sum(s.label == label for s in settings) / len(settings),
    )
    for subset in itertools.chain(([name] for name in names), itertools.combinations(names, 2)):
        rule, _ = tree_rule(settings, list(subset))
        if rule.training_accuracy > best.training_accuracy:
            best = rule
    return best


def training_settings(scored: SettingRecord, settings: Sequence[SettingRecord], train: str) -> list[SettingRecord]:
    """The settings a rule that scores `scored` may be fitted on: those sharing no expert with it (and, with
    `train="real"`, real ones only)."""
    if train not in TRAIN_SETS:
        raise ValueError(f"`train` must be one of {TRAIN_SETS}, got {train!r}")
    return [s for s in settings if not set(s.experts) & set(scored.experts) and (train == "all" or s.source == "real")]


def heldout_rows(settings: Sequence[SettingRecord], train: str = "all") -> list[dict]:
    """Per real setting: its label, the held-out rule's verdict, what the rule read, and each baseline's answer.

    A real setting with no setting left to fit on is scored by nothing: it is left out (and counted by the caller).
    """
    rows = []
    for scored in settings:
        if scored.source != "real":
            continue
        fold = training_settings(scored, settings, train)
        if not fold:
            continue
        rule = fit_label_rule(fold)
        baselines = {f"always {label}": label for label in OUTCOMES}
        baselines["majority"] = majority(s.label for s in fold)
        rows.append(
            {
                "name": scored.name,
                "kind": setting_kind(scored),
                "label": scored.label,
                "predicted": rule.verdict(scored.diagnostics),
                "rule": rule.describe(),
                "reads": rule.features(),
                "fitted_on": len(fold),
                "baselines": baselines,
            }
        )
    return rows


def evaluate(rows: Sequence[dict]) -> dict:
    """The rule's and each baseline's held-out accuracy, the confusion table, and whether the target is met."""
    rule = accuracy([row["predicted"] == row["label"] for row in rows])
    baselines = {name: accuracy([row["baselines"][name] == row["label"] for row in rows]) for name in BASELINES}
    confusion = {label: dict.fromkeys(OUTCOMES, 0) for label in OUTCOMES}
    for row in rows:
        confusion[row["label"]][row["predicted"]] += 1
    best = max(BASELINES, key=lambda name: (baselines[name]["correct"], -BASELINES.index(name))) if rows else None
    margin = None if best is None else rule["accuracy"] - baselines[best]["accuracy"]
    return {
        "rule": rule,
        "baselines": baselines,
        "best_baseline": best,
        "margin": margin,
        "beats_every_baseline": bool(rows) and margin > 0,
        "meets_target": bool(rows) and rule["accuracy"] >= TARGET_ACCURACY and margin >= TARGET_MARGIN,
        "confusion": confusion,
        "labels": {label: sum(row["label"] == label for row in rows) for label in OUTCOMES},
    }


def setting_kind(setting: SettingRecord) -> str:
    """A real setting's kind (`pair_kind` of its skills, the part of each expert after its base; "other" for
    skills the real settings do not define, or a number of experts other than two); a synthetic setting's is
    "synthetic"."""
    if setting.source != "real":
        return "synthetic"
    skills = [expert.rsplit(":", 1)[-1] for expert in setting.experts]
    try:
        return pair_kind(*skills) if len(skills) == 2 else "other"
    except ValueError:
        return "other"


def _test_share(setting: SettingRecord, system: str) -> float:
    rights = setting.rights(system, "test")
    return sum(rights) / len(rights)


def tracking(settings: Sequence[SettingRecord], min_settings: int = 4) -> dict:
    """Per kind of real setting, and over all ("all real"): for each diagnostic defined on at least `min_settings`
    of them and not constant, Spearman ρ with a bootstrap 95 % interval against the composition's lead
    (`compose_lead`, compose − merge test accuracy) and against the merge winning (`merge_wins`)."""
    real = [s for s in settings if s.source == "real"]
    groups: dict[str, list[SettingRecord]] = {"all real": real}
    for setting in real:
        groups.setdefault(setting_kind(setting), []).append(setting)
    report = {}
    for kind, members in groups.items():
        lead = [_test_share(s, s.chosen.compose) - _test_share(s, s.chosen.merge) for s in members]
        wins = [float(s.label == "merge") for s in members]
        rows = {}
        for name in dict.fromkeys(name for s in members for name in s.diagnostics):
            pairs = [
                (value, lead[i], wins[i])
                for i, s in enumerate(members)
                if (value := s.diagnostics.get(name)) is not None and math.isfinite(value)
            ]
            if len(pairs) < min_settings or len({p[0] for p in pairs}) < 2:
                continue
            x = [p[0] for p in pairs]
            rows[name] = {
                "compose_lead": correlation_with_interval(x, [p[1] for p in pairs]),
                "merge_wins": correlation_with_interval(x, [p[2] for p in pairs]),
            }
        report[kind] = {"n": len(members), "labels": dict(Counter(s.label for s in members)), "diagnostics": rows}
    return report


def refit(settings: Sequence[SettingRecord]) -> dict:
    """fit-rule's results: per training set ("all", "real"), the held-out rows and their evaluation, and the rule
    fitted on all of that set; and what tracks what."""
    real = [s for s in settings if s.source == "real"]
    if not real:
        raise ValueError("the records hold no real setting: the rule is scored on real settings only")
    fits = {}
    for train in TRAIN_SETS:
        rows = heldout_rows(settings, train)
        pool = [s for s in settings if train == "all" or s.source == "real"]
        fits[train] = {
            "n_scored": len(rows),
            "unscored": sorted({s.name for s in real} - {row["name"] for row in rows}),
            "heldout": evaluate(rows),
            "rows": rows,
            "rule": fit_label_rule(pool).model_dump(mode="json"),
        }
    return {"n_settings": len(settings), "n_real": len(real), "fits": fits, "tracking": tracking(settings)}


def _percent(score: Mapping) -> str:
    if score["accuracy"] is None:
        return "–"
    low, high = score["ci95"]
    return f"{100 * score['accuracy']:.1f} % [{100 * low:.0f}, {100 * high:.0f}] ({score['correct']}/{score['n']})"


def refit_markdown(results: Mapping, top: int = 5) -> str:
    """results.md: per training set, the held-out accuracies against the baselines; then, per kind, the
    diagnostics that track the composition's lead most strongly."""
    lines = [f"# The four-label rule, refitted: {results['n_real']} real settings of {results['n_settings']}", ""]
    for train, fit in results["fits"].items():
        held = fit["heldout"]
        lines += [
            f"## Fitted on {'every setting' if train == 'all' else 'real settings only'}",
            "",
            f"Scored held out on {fit['n_scored']} real settings"
            + (f" (no setting left to fit on: {', '.join(fit['unscored'])})" if fit["unscored"] else "")
            + ".",
            "",
            "| answer | held-out accuracy |",
            "|---|---|",
            f"| the rule | {_percent(held['rule'])} |",
            *(f"| {name} | {_percent(score)} |" for name, score in held["baselines"].items()),
            "",
            f"Best baseline: {held['best_baseline'] or '–'}; the rule beats every baseline: "
            f"{'yes' if held['beats_every_baseline'] else 'no'}; target (>= 80 %, >= 15 points over every "
            f"baseline) met: {'yes' if held['meets_target'] else 'no'}.",
            "",
            f"Fitted on all of them: `{LabelRule.model_validate(fit['rule']).describe()}`.",
            "",
        ]
    lines += ["## What tracks the composition's lead (Spearman ρ, bootstrap 95 % interval)", ""]
    for kind, entry in results["tracking"].items():
        ranked = sorted(entry["diagnostics"].items(), key=lambda item: -abs(item[1]["compose_lead"]["rho"] or 0.0))[
            :top
        ]
        lines += [f"**{kind}** (n = {entry['n']}, labels {entry['labels']}):", ""]
        if not ranked:
            lines += ["too few settings for a correlation.", ""]
            continue
        lines += ["| diagnostic | ρ with compose − merge | ρ with merge wins |", "|---|---|---|"]
        for name, values in ranked:
            lines.append(f"| {name} | {_rho(values['compose_lead'])} | {_rho(values['merge_wins'])} |")
        lines.append("")
    return "\n".join(lines)


def _rho(value: Mapping) -> str:
    if value["rho"] is None:
        return "undefined"
    interval = value["ci95"]
    return f"{value['rho']:+.2f}" + (f" [{interval[0]:+.2f}, {interval[1]:+.2f}]" if interval else "")
