"""Should these experts be merged or composed? Unlabelled diagnostics, and the rule that reads them.

Everything here uses only what a user has: the base, the experts, prompts from the joint task's
input distribution, and the composed model's own greedy rollouts from them. No gold target and
no knowledge of which expert owns which step: where a statistic needs an owner, the *activity
proxy* stands in for it, the expert with the largest `KL(p_i ‖ p_b)` at a position if that is
above ε (none otherwise).

* `proxy_owner_statistics`: per measured position, the composition against the proxy owner's
  own composition `log p_b + w_o (log p_o − log p_b)` (renormalised): how often the silent
  experts' summed deltas flip the argmax, and how far they move the distribution; plus how
  unsure the composition is of its own tokens.
* `unlabelled_diagnostics`: every `measure_overlap` statistic on the rollouts (both centres),
  the above, and the parameter-space measures, as one flat `{name: float}`.
* `VerdictRule`: thresholds fitted by `mergecompose predict-sweep` on synthetic tasks
  (`mergecompose.experiments.predict`), shipped as `predict_rule.json`; `recommend` applies it and says why.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from mergecompose.analysis.diagnostics import expert_activity
from mergecompose.analysis.measure import batch_tensors, measure_overlap
from mergecompose.analysis.settings import OverlapSettings
from mergecompose.composition import ComposedLM, compose_with_remedies
from mergecompose.composition.rule import check_weights, compose_logprobs

CENTRES = ("base_weighted_median", "median")
# The verdict's classes; a system "succeeds" at exact match >= the rule's `success_threshold`.
VERDICTS = ("either", "compose", "merge", "compose+gate", "neither")
RULE_FILE = "predict_rule.json"


@torch.no_grad()
def proxy_owner_statistics(
    composed: ComposedLM, batches: Iterable[Mapping[str, torch.Tensor]], epsilon: float = 0.1, confident: float = 0.5
) -> dict[str, float]:
    """What the silent experts (silent by the activity proxy) do to the composition, on `batches`.

    At each measured position the proxy owner is `o = argmax_i KL(p_i ‖ p_b)` if that KL is above
    `epsilon`, else none. The owner-only composition is `log r ∝ log p_b + w_o (log p_o − log p_b)`
    (the base where none is active); the composition adds every other expert's delta to it.

    Returns (means over measured positions):
        `silent_flip_rate`: argmax of the composition ≠ argmax of the owner-only composition;
        `silent_shift_kl`: KL(r ‖ p̂), nats;
        `silent_positions`: share of positions where some expert is not the owner;
        `low_confidence_rate`: the composition's top probability is below `confident`;
        `composed_entropy`: the composition's entropy, nats.
    """
    totals = dict.fromkeys(("silent_flip_rate", "silent_shift_kl", "low_confidence_rate", "composed_entropy"), 0.0)
    count = 0
    weights = torch.tensor(
        check_weights(composed.weights, composed.num_experts) or [1.0] * composed.num_experts
    )  # (k,)
    for index, batch in enumerate(batches):
        batch = batch_tensors(batch, index)
        attention = batch.get("attention_mask")
        if attention is None:
            attention = torch.ones_like(batch["input_ids"])
        mask = batch.get("measure_mask")
        mask = attention.bool() if mask is None else mask.bool() & attention.bool()  # (B, T)
        components = composed.component_logprobs(
            batch["input_ids"], attention, batch.get("position_ids")
        )  # (k+1, B, T, V)
        components = components[:, mask.to(components.device)]  # (k+1, N, V)
        base, experts = components[0], components[1:]
        composed_logprobs = compose_with_remedies(components, composed.weights, composed.remedies)  # (N, V)
        activity = expert_activity(base, experts)  # (k, N)
        strongest, owner = activity.max(dim=0)  # (N,)
        has_owner = strongest > epsilon  # (N,)
        owner_weight = torch.where(has_owner, weights.to(base.device)[owner], 0.0)  # (N,)
        owner_logprobs = experts[owner, torch.arange(owner.shape[0])]  # (N, V)
        owner_only = compose_logprobs(base, [owner_logprobs], weights=owner_weight.unsqueeze(0))  # (N, V)
        flips = owner_only.argmax(-1) != composed_logprobs.argmax(-1)  # (N,)
        shift = (owner_only.exp() * (owner_only - composed_logprobs)).nan_to_num(0.0).sum(-1)  # (N,)
        probabilities = composed_logprobs.exp()
        entropy = -(probabilities * composed_logprobs).nan_to_num(0.0).sum(-1)  # (N,)
        totals["silent_flip_rate"] += float(flips.sum())
        totals["silent_shift_kl"] += float(shift.clamp(min=0).sum())
        totals["low_confidence_rate"] += float((probabilities.max(-1).values < confident).sum())
        totals["composed_entropy"] += float(entropy.sum())
        count += owner.shape[0]
    if count == 0:
        raise ValueError("`batches` measure no position; nothing to compute")
    return {name: value / count for name, value in totals.items()}


def _pairs(report: dict, key: str) -> list[float]:
    return [pair[key] for pair in report["pairs"].values() if pair.get(key) is not None]


def _parameter(report: dict, key: str) -> list[float]:
    return [
        pair["parameter"][key]
        for pair in report["pairs"].values()
        if (pair.get("parameter") or {}).get(key) is not None
    ]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def flatten_report(reports: Mapping[str, dict]) -> dict[str, float | None]:
    """The flat diagnostics of `measure_overlap` summaries, one per centre (`CENTRES`).

    Pair statistics (k ≥ 2 experts give k(k−1)/2 pairs) enter as their mean and their largest value;
    names of the median centre end in `_median`, those of the default (base-weighted) centre do not.
    """
    main = reports[CENTRES[0]]
    flat: dict[str, float | None] = {"num_experts": float(len(main["experts"]))}
    for epsilon, rate in main["coactivation_by_epsilon"].items():
        flat[f"coactivation_rate@{epsilon}"] = rate
    for centre, suffix in zip(CENTRES, ("", "_median")):
        report = reports[centre]
        for key in ("mass_overlap", "sign_conflict", "support_jaccard"):
            values = _pairs(report, key)
            flat[f"{key}_mean{suffix}"] = _mean(values)
            flat[f"{key}_max{suffix}"] = max(values, default=None)
        bounds = [
            pair["mass_overlap_bounds"][1] for pair in report["pairs"].values() if pair.get("mass_overlap_bounds")
        ]
        flat[f"mass_overlap_upper_max{suffix}"] = max(bounds, default=None)
    gap = main.get("merge_compose_gap") or {}
    flat["merge_compose_kl"] = gap.get("kl_mean")
    flat["merge_compose_kl_p95"] = gap.get("kl_p95")
    flat["merge_compose_top1_disagreement"] = None if gap.get("top1_agreement") is None else 1 - gap["top1_agreement"]
    flat["interaction_residual_relative"] = gap.get("interaction_residual_relative")
    experts = main["experts"].values()
    flat["linearization_error_mean"] = _mean(
        [e["linearization_error"] for e in experts if e.get("linearization_error") is not None]
    )
    flat["projective_error"] = main["projective_error"]["single_active"]
    flat["projective_error_active_max"] = max(
        (e["projective_error_active"] for e in experts if e.get("projective_error_active") is not None), default=None
    )
    flat["expert_kl_mean"] = _mean([e["kl_mean"] for e in experts])
    flat["active_fraction_mean"] = _mean([e["active_fraction"] for e in experts])
    flat["active_fraction_sum"] = sum(e["active_fraction"] for e in experts)
    for key in ("cosine", "ties_sign_conflict", "trimmed_mask_jaccard"):
        values = _parameter(main, key)
        flat[f"parameter_{key}_max"] = max(values, default=None)
        flat[f"parameter_{key}_mean"] = _mean(values)
    return flat


def unlabelled_diagnostics(
    composed: ComposedLM,
    rollouts: list[Mapping[str, torch.Tensor]],
    merged_model: torch.nn.Module | None = None,
    task_vectors: Mapping[str, object] | None = None,
    settings: OverlapSettings | None = None,
    progress: bool = False,
) -> tuple[dict[str, float | None], dict[str, dict]]:
    """Every diagnostic of the composed model's own rollouts (`mergecompose.analysis.rollout_batches`), flat.

    `merged_model` (the task-arithmetic merge at the composition's weights) gives the merge–compose
    gap; `task_vectors` the parameter-space measures. Returns `(flat, reports)`: `flatten_report`'s
    names plus `proxy_owner_statistics`', and the `measure_overlap` summaries by centre.
    """
    settings = settings or OverlapSettings()
    reports = {}
    for centre in CENTRES:
        report = measure_overlap(
            composed,
            rollouts,
            merged_model=merged_model,
            settings=settings.model_copy(update={"centre": centre}),
            task_vectors=task_vectors if centre == CENTRES[0] else None,
            progress=progress,
            description=f"rollouts ({centre})",
        )
        reports[centre] = report.summary()
    flat = flatten_report(reports)
    flat.update(proxy_owner_statistics(composed, rollouts, settings.epsilon))
    return flat, reports


# ---------------------------------------------------------------------------------------------
# The verdict rule


class Threshold(BaseModel):
    """`feature >= threshold` (direction "above") or `feature < threshold` ("below") predicts success."""

    model_config = ConfigDict(extra="forbid")

    feature: str | None = None  # None: a constant prediction, `constant`
    threshold: float | None = None
    direction: str = "above"
    constant: bool | None = None
    training_accuracy: float | None = None

    def predict(self, diagnostics: Mapping[str, float | None]) -> bool:
        if self.feature is None:
            return bool(self.constant)
        value = diagnostics.get(self.feature)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            raise ValueError(
                f"the rule needs diagnostic {self.feature!r}, which these diagnostics lack (got {value!r})"
            )
        above = value >= self.threshold
        return above if self.direction == "above" else not above

    def describe(self, diagnostics: Mapping[str, float | None] | None = None) -> str:
        if self.feature is None:
            return f"always {'succeeds' if self.constant else 'fails'} (one outcome in the training settings)"
        sign = "≥" if self.direction == "above" else "<"
        text = f"succeeds when {self.feature} {sign} {self.threshold:.4g}"
        if diagnostics is not None:
            verdict = "yes" if self.predict(diagnostics) else "no"
            text += f"; here {self.feature} = {diagnostics[self.feature]:.4g} → {verdict}"
        return text


class VerdictRule(BaseModel):
    """Three thresholds: does plain composition succeed, does the best merge, does the gated composition.

    The verdict: `either` when composition and merge both succeed; `compose` / `merge` when only
    one does; `compose+gate` when neither does but the remedy does; else `neither`.
    """

    model_config = ConfigDict(extra="forbid")

    compose: Threshold
    merge: Threshold
    remedy: Threshold
    success_threshold: float = Field(0.9, ge=0, le=1)
    heldout_accuracy: float | None = None
    n_settings: int | None = None
    sweep: dict = Field(default_factory=dict)  # which sweep fitted it: name, version, config hash

    def verdict(self, diagnostics: Mapping[str, float | None]) -> str:
        return combine_verdict(
            self.compose.predict(diagnostics), self.merge.predict(diagnostics), self.remedy.predict(diagnostics)
        )


def combine_verdict(compose: bool, merge: bool, remedy: bool) -> str:
    """One of `VERDICTS` from whether composition, the best merge and the remedy succeed."""
    if compose and merge:
        return "either"
    if compose:
        return "compose"
    if merge:
        return "merge"
    return "compose+gate" if remedy else "neither"


def load_rule(path: str | Path | None = None) -> VerdictRule:
    """The rule at `path`, or the one shipped with the package (`analysis/predict_rule.json`)."""
    if path is None:
        text = resources.files("analysis").joinpath(RULE_FILE).read_text(encoding="utf-8")
    else:
        text = Path(path).read_text(encoding="utf-8")
    return VerdictRule.model_validate(json.loads(text))


def recommend(rule: VerdictRule, diagnostics: Mapping[str, float | None]) -> dict:
    """The verdict with its evidence: each threshold, where these diagnostics sit, and the rule's held-out accuracy."""
    return {
        "verdict": rule.verdict(diagnostics),
        "evidence": {name: getattr(rule, name).describe(diagnostics) for name in ("compose", "merge", "remedy")},
        "heldout_accuracy": rule.heldout_accuracy,
        "n_settings": rule.n_settings,
        "sweep": rule.sweep,
        "caveat": "fitted on the toolkit's synthetic tasks (letter replacement, sequential skills) with small models; "
        "a guide for what to measure on your own experts, not a guarantee",
        "diagnostics": dict(diagnostics),
    }
