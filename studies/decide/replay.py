"""The sequential rule replayed over the records of finished sweeps: would `decide` have given each setting's
full-n label, how often would it have been wrong, and how many test items would it have used?

For every setting of a records file (`mergecompose.studies.predict.records`) the chosen merge's and composition's
right/wrong on its n test items are replayed in `orders` random orders (numpy's PCG64, seeded by `seed` and the
setting's place in the file), each with a budget of n, as `decide` would score them. Per setting and per source
(real, synthetic, all), over settings × orders:

* **agreement**: the rule's label equals the full-n paired label (`paired_outcome` on all n items);
* **wrong**: "merge" where the full n says "compose" or the other way, or "neither" where one side reaches the
  floor on the full n (the errors the rule's α bounds; "either" against a full-n "merge" is a disagreement, not
  an error: at n items the full-n test may see a difference within ±δ);
* **share used**: the items the rule used over n (mean), and how often it reached the budget.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from mergecompose.analysis.sequential_decision import DecisionSettings, replay_orders
from mergecompose.core.io import markdown_table
from mergecompose.studies.predict.records import SettingsRecords

SOURCES = ("real", "synthetic", "all")
TARGETS = {"wrong": 0.05, "agreement": 0.90, "share_used": 0.50}  # at most, at least, at most


def is_wrong(label: str, full_label: str, merge_share: float, compose_share: float, floor: float) -> bool:
    """A decision the rule's error rate bounds: the wrong side, or "neither" where a side reaches the floor."""
    if {label, full_label} == {"merge", "compose"}:
        return True
    return label == "neither" and max(merge_share, compose_share) >= floor


def replay_records(
    records: SettingsRecords, orders: int = 100, seed: int = 0, settings: DecisionSettings | None = None
) -> dict:
    """Every setting replayed (see the module docstring); returns `{"settings": [...], "summary": {...}}`."""
    if orders < 1:
        raise ValueError(f"`orders` must be at least 1, got {orders}")
    settings = settings or DecisionSettings(alpha=records.alpha, floor=records.floor)
    rows = []
    for index, setting in enumerate(records.settings):
        merge, compose = setting.merge_test, setting.compose_test
        full = setting.outcome(settings.alpha, settings.floor)
        decisions = replay_orders(merge, compose, orders, seed * 100_003 + index, settings)
        n = len(merge)
        labels = [decision.label for decision in decisions]
        wrong = [
            is_wrong(label, full.label, full.merge_right / n, full.compose_right / n, settings.floor)
            for label in labels
        ]
        rows.append(
            {
                "name": setting.name,
                "source": setting.source,
                "items": n,
                "full_label": full.label,
                "merge_accuracy": full.merge_right / n,
                "compose_accuracy": full.compose_right / n,
                "labels": dict(Counter(labels)),
                "agreement": sum(label == full.label for label in labels) / orders,
                "wrong": sum(wrong) / orders,
                "share_used": float(np.mean([decision.items for decision in decisions])) / n,
                "budget_reached": sum(decision.budget_reached for decision in decisions) / orders,
            }
        )
    summary = {}
    for source in SOURCES:
        chosen = [row for row in rows if source == "all" or row["source"] == source]
        if not chosen:
            continue
        values = {
            key: float(np.mean([row[key] for row in chosen]))
            for key in ("agreement", "wrong", "share_used", "budget_reached")
        }
        summary[source] = {
            "settings": len(chosen),
            **values,
            "met": {
                "wrong": values["wrong"] <= TARGETS["wrong"],
                "agreement": values["agreement"] >= TARGETS["agreement"],
                "share_used": values["share_used"] <= TARGETS["share_used"],
            },
        }
    return {
        "orders": orders,
        "seed": seed,
        "settings": rows,
        "summary": summary,
        "rule": {"alpha": settings.alpha, "delta": settings.delta, "floor": settings.floor},
        "targets": TARGETS,
    }


def replay_markdown(results: dict) -> str:
    percent = lambda value: f"{100 * value:.1f} %"  # noqa: E731
    summary = markdown_table(
        ["settings", "n", "agreement with the full-n label", "wrong decisions", "test items used", "budget reached"],
        [
            [source, row["settings"], percent(row["agreement"]), percent(row["wrong"]), percent(row["share_used"]),
             percent(row["budget_reached"])]
            for source, row in results["summary"].items()
        ],
    )  # fmt: skip
    settings = markdown_table(
        ["setting", "source", "n", "merge", "compose", "full-n label", "labels over orders", "agreement", "wrong",
         "used"],
        [
            [row["name"], row["source"], row["items"], percent(row["merge_accuracy"]), percent(row["compose_accuracy"]),
             row["full_label"], ", ".join(f"{k} {v}" for k, v in sorted(row["labels"].items())),
             percent(row["agreement"]), percent(row["wrong"]), percent(row["share_used"])]
            for row in results["settings"]
        ],
    )  # fmt: skip
    rule = results["rule"]
    return (
        f"# The sequential rule, replayed\n\n{results['orders']} random orders per setting (seed {results['seed']}); "
        f"α = {rule['alpha']}, δ = {rule['delta']}, floor {rule['floor']}. Targets: wrong decisions ≤ 5 %, agreement "
        f"≥ 90 %, test items used ≤ 50 %.\n\n{summary}\n\n{settings}\n"
    )
