"""What predicts what, across the sweep's settings: rank correlations with bootstrap intervals, and the verdict rule.

* `spearman_with_interval`: Spearman ρ (scipy), its p-value, and a 95 % percentile bootstrap
  interval over settings (resampled with replacement).
* `partial_spearman`: ρ of x and y with the experts' own accuracy z partialled out: the Pearson
  correlation of the residuals of rank(x) and rank(y) after a least-squares fit on rank(z)
  (a weak expert makes its composition fail for a boring reason).
* `fit_threshold`: the single diagnostic and threshold that best separate successes from failures.
* `leave_one_family_out`: the verdict rule fitted without a family, scored on that family.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
from scipy import stats

from mergecompose.analysis.predict import VERDICTS, Threshold, VerdictRule, combine_verdict

OUTCOMES = {"compose_error": "spearman_compose_error", "merge_error": "spearman_merge_error", "gap": "spearman_gap"}


def outcome_columns(records: Sequence[dict], success_threshold: float) -> dict[str, np.ndarray]:
    """Per setting: errors, the compose − merge gap, the weakest expert, and which systems succeed."""
    compose = np.array([r["outcomes"]["compose"] for r in records])
    merge = np.array([r["outcomes"]["best_merge"] for r in records])
    remedy = np.array([r["outcomes"]["best_remedy"] for r in records])
    experts = np.array([min(r["outcomes"]["experts"].values()) for r in records])
    return {
        "compose_error": 1 - compose,
        "merge_error": 1 - merge,
        "gap": compose - merge,
        "experts_min": experts,
        "compose_ok": compose >= success_threshold,
        "merge_ok": merge >= success_threshold,
        "remedy_ok": remedy >= success_threshold,
    }


def _row_ranks(values: np.ndarray) -> np.ndarray:
    return stats.rankdata(values, axis=-1)


def _row_pearson(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson r of each row pair `(B, n)`; NaN where a row is constant."""
    x = x - x.mean(-1, keepdims=True)
    y = y - y.mean(-1, keepdims=True)
    denominator = np.sqrt((x * x).sum(-1) * (y * y).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator > 0, (x * y).sum(-1) / denominator, np.nan)


def _residuals(values: np.ndarray, control: np.ndarray) -> np.ndarray:
    """Rows of `values` minus their least-squares fit on `control` (with intercept), row by row `(B, n)`."""
    control = control - control.mean(-1, keepdims=True)
    centred = values - values.mean(-1, keepdims=True)
    variance = (control * control).sum(-1, keepdims=True)
    slope = np.where(
        variance > 0, (centred * control).sum(-1, keepdims=True) / np.where(variance > 0, variance, 1), 0.0
    )
    return centred - slope * control


def _statistic(x: np.ndarray, y: np.ndarray, control: np.ndarray | None) -> np.ndarray:
    """Spearman ρ (or, with `control`, the partial ρ) of each row `(B, n)`."""
    rx, ry = _row_ranks(x), _row_ranks(y)
    if control is None:
        return _row_pearson(rx, ry)
    rz = _row_ranks(control)
    return _row_pearson(_residuals(rx, rz), _residuals(ry, rz))


def correlation_with_interval(x, y, control=None, resamples: int = 2000, seed: int = 0) -> dict:
    """`{"rho", "ci95", "p", "n"}`: Spearman ρ (partial, given `control`) with a bootstrap 95 % interval.

    The p-value is scipy's `spearmanr` for plain ρ; for the partial ρ, the t-test with n − 3 degrees
    of freedom. ρ is None where x or y is constant; the interval drops resamples where it is undefined.
    """
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    control = None if control is None else np.asarray(control, dtype=float)
    n = x.size
    rho = float(_statistic(x[None], y[None], None if control is None else control[None])[0])
    if math.isnan(rho):
        return {"rho": None, "ci95": None, "p": None, "n": n}
    if control is None:
        p = float(stats.spearmanr(x, y).pvalue)
    else:
        dof = n - 3
        t = rho * math.sqrt(dof / max(1e-300, 1 - rho * rho)) if dof > 0 else float("nan")
        p = float(2 * stats.t.sf(abs(t), dof)) if dof > 0 else None
    rng = np.random.default_rng(seed)
    index = rng.integers(0, n, size=(resamples, n))  # (B, n)
    boot = _statistic(x[index], y[index], None if control is None else control[index])
    boot = boot[~np.isnan(boot)]
    interval = [float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))] if boot.size else None
    return {"rho": rho, "ci95": interval, "p": p, "n": n}


def usable_diagnostics(records: Sequence[dict]) -> list[str]:
    """Diagnostics that every setting has (no None) and that vary across settings."""
    names = list(records[0]["diagnostics"])
    usable = []
    for name in names:
        values = [r["diagnostics"].get(name) for r in records]
        if any(v is None or (isinstance(v, float) and math.isnan(v)) for v in values):
            continue
        if len(set(values)) > 1:
            usable.append(name)
    return usable


def fit_threshold(features: dict[str, np.ndarray], target: np.ndarray) -> Threshold:
    """The (feature, threshold, direction) with the highest training *balanced* accuracy on the boolean `target`.

    Balanced accuracy, the mean of the rates on successes and on failures, so that the rarer
    outcome counts as much as the common one. Thresholds are midpoints between consecutive
    distinct values; ties keep the first feature (in `features` order) and the lower threshold.
    A constant `target` gives a constant rule.
    """
    target = np.asarray(target, dtype=bool)
    if target.all() or not target.any():
        return Threshold(constant=bool(target[0]), training_accuracy=1.0)
    best = None
    for name, values in features.items():
        distinct = np.unique(values)
        for threshold in (distinct[:-1] + distinct[1:]) / 2:
            above = values >= threshold
            for direction, predicted in (("above", above), ("below", ~above)):
                accuracy = float(
                    0.5 * ((predicted & target).sum() / target.sum() + (~predicted & ~target).sum() / (~target).sum())
                )
                if best is None or accuracy > best[0]:
                    best = (accuracy, name, float(threshold), direction)
    accuracy, name, threshold, direction = best
    return Threshold(feature=name, threshold=threshold, direction=direction, training_accuracy=accuracy)


def fit_rule(records: Sequence[dict], names: Sequence[str], success_threshold: float) -> VerdictRule:
    columns = outcome_columns(records, success_threshold)
    features = {name: np.array([r["diagnostics"][name] for r in records], dtype=float) for name in names}
    return VerdictRule(
        compose=fit_threshold(features, columns["compose_ok"]),
        merge=fit_threshold(features, columns["merge_ok"]),
        remedy=fit_threshold(features, columns["remedy_ok"]),
        success_threshold=success_threshold,
        n_settings=len(records),
    )


def true_verdicts(records: Sequence[dict], success_threshold: float) -> list[str]:
    columns = outcome_columns(records, success_threshold)
    return [
        combine_verdict(c, m, r) for c, m, r in zip(columns["compose_ok"], columns["merge_ok"], columns["remedy_ok"])
    ]


def leave_one_family_out(records: Sequence[dict], names: Sequence[str], success_threshold: float) -> dict:
    """`{"heldout_accuracy", "confusion", "n_settings", "per_family"}`: each family scored by a rule fitted on the
    others.

    `confusion[true][predicted]` counts settings. With a single family nothing can be held out:
    the accuracy is None.
    """
    truth = true_verdicts(records, success_threshold)
    families = list(dict.fromkeys(r["family"] for r in records))
    confusion = {verdict: dict.fromkeys(VERDICTS, 0) for verdict in VERDICTS}
    per_family, correct, scored = {}, 0, 0
    if len(families) > 1:
        for family in families:
            train = [r for r in records if r["family"] != family]
            rule = fit_rule(train, names, success_threshold)
            hits = 0
            members = [(r, t) for r, t in zip(records, truth) if r["family"] == family]
            for record, expected in members:
                predicted = rule.verdict(record["diagnostics"])
                confusion[expected][predicted] += 1
                hits += predicted == expected
            per_family[family] = {"accuracy": hits / len(members), "n": len(members)}
            correct, scored = correct + hits, scored + len(members)
    return {
        "heldout_accuracy": correct / scored if scored else None,
        "confusion": confusion,
        "n_settings": len(records),
        "per_family": per_family,
    }


def best_combination(
    records: Sequence[dict], names: Sequence[str], singles: dict, target: np.ndarray, resamples: int, seed: int
) -> dict | None:
    """The two-diagnostic combination (the sum of their signed ranks) with the largest |ρ| against `target`.

    Each diagnostic enters with the sign of its own ρ. The pair is chosen on the same settings it
    is scored on, so its ρ is optimistic; the bootstrap interval does not include the choice.
    """
    ranked = {
        name: np.sign(singles[name]["rho"]) * stats.rankdata([r["diagnostics"][name] for r in records])
        for name in names
        if singles[name]["rho"]
    }
    best = None
    for a, b in itertools.combinations(ranked, 2):
        combined = ranked[a] + ranked[b]
        rho = _statistic(combined[None], target[None], None)[0]
        if not math.isnan(rho) and (best is None or abs(rho) > abs(best[0])):
            best = (rho, a, b, combined)
    if best is None:
        return None
    rho, a, b, combined = best
    return {"features": [a, b], **correlation_with_interval(combined, target, resamples=resamples, seed=seed)}


def analyse(records: Sequence[dict], config) -> dict:
    """predict.json's `diagnostics`, `best`, `verdict` and `rule` from the settings' records."""
    columns = outcome_columns(records, config.success_threshold)
    names = usable_diagnostics(records)
    table = {}
    for name in names:
        x = np.array([r["diagnostics"][name] for r in records], dtype=float)
        entry = {
            key: correlation_with_interval(x, columns[column], resamples=config.bootstrap, seed=config.seed)
            for column, key in OUTCOMES.items()
        }
        entry["partial_compose_error"] = correlation_with_interval(
            x, columns["compose_error"], columns["experts_min"], resamples=config.bootstrap, seed=config.seed
        )
        table[name] = entry
    defined = [n for n in names if table[n]["spearman_compose_error"]["rho"] is not None]
    best = {}
    for key in ("spearman_compose_error", "spearman_merge_error", "spearman_gap", "partial_compose_error"):
        candidates = [n for n in names if table[n][key]["rho"] is not None]
        if candidates:
            top = max(candidates, key=lambda n: abs(table[n][key]["rho"]))
            best[key] = {"diagnostic": top, **table[top][key]}
    singles = {n: table[n]["spearman_compose_error"] for n in defined}
    combination = None
    if len(defined) >= 2:
        combination = best_combination(
            records, defined, singles, columns["compose_error"], config.bootstrap, config.seed
        )
    verdict = leave_one_family_out(records, names, config.success_threshold)
    rule = fit_rule(records, names, config.success_threshold) if names else None
    candidates = [best.get("spearman_compose_error"), combination]
    met = [
        c
        for c in candidates
        if c
        and c["rho"] is not None
        and abs(c["rho"]) >= 0.8
        and c["ci95"]
        and min(abs(c["ci95"][0]), abs(c["ci95"][1])) > 0.5
        and c["ci95"][0] * c["ci95"][1] > 0
    ]
    return {
        "diagnostics": table,
        "best": best,
        "combination": combination,
        "target": {"met": bool(met), "rule": "|ρ| ≥ 0.8 against composition error, 95 % interval excluding |ρ| = 0.5"},
        "verdict": {**verdict, "truth": true_verdicts(records, config.success_threshold)},
        "rule": None if rule is None else rule.model_dump(mode="json"),
    }
