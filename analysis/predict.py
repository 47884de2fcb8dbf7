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
* `diagnostic_names`: those names, known before anything is measured, so that a rule naming one the
  overlap does not measure is refused before any model loads (`check_rule_diagnostics`).
* `VerdictRule`: thresholds fitted by `mergecompose predict-sweep` on synthetic tasks
  (`mergecompose.studies.predict`), shipped as `predict_rule.json`; `recommend` applies it and says why. Its
  verdict is a decision only where the rule's score on real experts (`VerdictRule.real_settings`,
  `mergecompose.analysis.real_settings_score`) beats always answering the most common label.
  A diagnostic that comes out undefined on the data (None: e.g. the single-active projective error
  where every position is co-active) does not fail the verdict: see `VerdictRule.verdict`. Its
  top-1-shift twin, `projective_error_dominant`, stays defined there (`shift_diagnostics`).
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Iterable, Mapping
from importlib import resources
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mergecompose.analysis.diagnostics import expert_activity
from mergecompose.analysis.input_interference import input_interference
from mergecompose.analysis.measure import batch_tensors, measure_overlap
from mergecompose.analysis.overlap_settings import OverlapSettings
from mergecompose.analysis.real_settings_score import RealSettingsScore
from mergecompose.composition import ComposedLM, compose_with_remedies
from mergecompose.composition.rule import check_weights, compose_logprobs
from mergecompose.core.boundary import check_text_file
from mergecompose.core.io import validation_message

CENTRES = ("base_weighted_median", "median")
# The verdict's classes; a system "succeeds" at exact match >= the rule's `success_threshold`.
VERDICTS = ("either", "compose", "merge", "compose+gate", "neither")
# The verdict when a diagnostic the rule reads is undefined and the verdicts it allows differ.
UNDECIDED = "undecided"
RULE_FILE = "predict_rule.json"
RULE_PARTS = ("compose", "merge", "remedy")

# The flat names of `flatten_report` and `proxy_owner_statistics`, by where they come from.
PAIR_STATISTICS = ("mass_overlap", "sign_conflict", "support_jaccard", "delta_norm_ratio")
GAP_STATISTICS = (
    "merge_compose_kl",
    "merge_compose_kl_p95",
    "merge_compose_top1_disagreement",
    "interaction_residual_relative",
)
EXPERT_STATISTICS = (
    "linearization_error_mean",
    "projective_error",
    "projective_error_dominant",
    "projective_error_active_max",
    "expert_kl_mean",
    "active_fraction_mean",
    "active_fraction_sum",
)
# Top-1 token shifts (`mergecompose.analysis.shift_diagnostics`): per expert, then per pair; the same-token
# share enters as its least value over pairs, the pair that pulls apart most.
SHIFT_STATISTICS = (
    "top1_shift_rate_mean",
    "top1_shift_rate_max",
    "top1_both_shift_rate_mean",
    "top1_both_shift_rate_max",
    "top1_same_shift_share_mean",
    "top1_same_shift_share_min",
)
PARAMETER_STATISTICS = ("cosine", "ties_sign_conflict", "trimmed_mask_jaccard")
# `mergecompose.analysis.retention`: the skill most lost in the merge and in the composition, merge minus
# composition, and the base's knowledge of the least known expert's top-1 tokens (everywhere, where it shifts).
RETENTION_STATISTICS = (
    "retention_kl_max_merge",
    "retention_kl_max_compose",
    "retention_kl_max_merge_minus_compose",
    "retention_kept_min_merge",
    "retention_kept_min_compose",
    "retention_kept_min_merge_minus_compose",
    "base_logprob_expert_top1_min",
    "base_logprob_expert_top1_shifted_min",
)
# `mergecompose.analysis.input_interference`, LoRA experts only: ρ over layers and ordered pairs.
INTERFERENCE_STATISTICS = ("lora_input_interference_mean", "lora_input_interference_max")
PROXY_OWNER_STATISTICS = ("silent_flip_rate", "silent_shift_kl", "low_confidence_rate", "composed_entropy")


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
    totals = dict.fromkeys(PROXY_OWNER_STATISTICS, 0.0)
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
        for key in PAIR_STATISTICS:
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
    flat["projective_error_dominant"] = main["projective_error"]["dominant_shift"]
    flat["projective_error_active_max"] = max(
        (e["projective_error_active"] for e in experts if e.get("projective_error_active") is not None), default=None
    )
    flat["expert_kl_mean"] = _mean([e["kl_mean"] for e in experts])
    flat["active_fraction_mean"] = _mean([e["active_fraction"] for e in experts])
    flat["active_fraction_sum"] = sum(e["active_fraction"] for e in experts)
    shift_rates = [e["top1_shift_rate"] for e in experts]
    flat["top1_shift_rate_mean"] = _mean(shift_rates)
    flat["top1_shift_rate_max"] = max(shift_rates, default=None)
    both = _pairs(main, "top1_both_shift_rate")
    flat["top1_both_shift_rate_mean"] = _mean(both)
    flat["top1_both_shift_rate_max"] = max(both, default=None)
    same = _pairs(main, "top1_same_shift_share")
    flat["top1_same_shift_share_mean"] = _mean(same)
    flat["top1_same_shift_share_min"] = min(same, default=None)
    for key in PARAMETER_STATISTICS:
        values = _parameter(main, key)
        flat[f"parameter_{key}_max"] = max(values, default=None)
        flat[f"parameter_{key}_mean"] = _mean(values)
    flat.update(_retention_statistics(main))
    return flat


def _retention_statistics(report: dict) -> dict[str, float | None]:
    """`RETENTION_STATISTICS` of one overlap summary (None where it has no retention, or the value is undefined)."""
    retention = report.get("retention") or {}
    lost, difference = retention.get("most_lost") or {}, retention.get("merge_minus_compose") or {}
    flat: dict[str, float | None] = {}
    for measure, kind in (("kl", "max"), ("kept", "min")):
        for system in ("merge", "compose"):
            flat[f"retention_{measure}_{kind}_{system}"] = lost.get(f"{system}_{measure}_{kind}")
        flat[f"retention_{measure}_{kind}_merge_minus_compose"] = difference.get(f"{measure}_{kind}")
    for key, name in (("base_logprob_mean", ""), ("base_logprob_mean_shifted", "_shifted")):
        values = [e[key] for e in report["experts"].values() if e.get(key) is not None]
        flat[f"base_logprob_expert_top1{name}_min"] = min(values, default=None)
    return flat


def is_undefined(value: object) -> bool:
    """Whether a diagnostic has no value: None (nothing to average over) or NaN."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def diagnostic_names(settings: OverlapSettings | None = None) -> list[str]:
    """Every name `unlabelled_diagnostics` returns with `settings`, known before anything is measured.

    The co-activation rates are measured at `settings.epsilons` only (`coactivation_rate@0.1`, ...).
    """
    settings = settings or OverlapSettings()
    names = ["num_experts", *(f"coactivation_rate@{epsilon}" for epsilon in settings.epsilons)]
    for suffix in ("", "_median"):
        names += [f"{key}_{kind}{suffix}" for key in PAIR_STATISTICS for kind in ("mean", "max")]
        names.append(f"mass_overlap_upper_max{suffix}")
    names += [*GAP_STATISTICS, *EXPERT_STATISTICS, *SHIFT_STATISTICS]
    names += [f"parameter_{key}_{kind}" for key in PARAMETER_STATISTICS for kind in ("max", "mean")]
    return names + list(RETENTION_STATISTICS) + list(INTERFERENCE_STATISTICS) + list(PROXY_OWNER_STATISTICS)


def undefined_reasons(
    diagnostics: Mapping[str, float | None], reports: Mapping[str, dict], settings: OverlapSettings | None = None
) -> dict[str, str]:
    """Why each diagnostic that is undefined in `diagnostics` (`is_undefined`) has no value: name -> reason.

    `reports` are `unlabelled_diagnostics`' summaries by centre; the reasons name what the data lacked.
    """
    settings = settings or OverlapSettings()
    main = reports[CENTRES[0]]
    return {name: _undefined_reason(name, main, settings) for name, value in diagnostics.items() if is_undefined(value)}


def _undefined_reason(name: str, report: dict, settings: OverlapSettings) -> str:
    experts = len(report["experts"])
    pair_names = (*PAIR_STATISTICS, "mass_overlap_upper", "parameter_", "top1_both_shift", "top1_same_shift")
    if experts < 2 and name.startswith(pair_names):
        return f"a statistic of expert pairs, and there is only {experts} expert"
    if name == "projective_error":
        return (
            f"no measured position has at most one active expert at ε = {settings.epsilon} (all "
            f"{report['num_positions']} positions are co-active), so the single-active projective error "
            "KL(p_active ‖ q) has no position to average over"
        )
    if name == "projective_error_dominant":
        return (
            f"no measured position (of {report['num_positions']}) has exactly one expert whose top-1 token differs "
            "from the base's, so the dominant-shift projective error KL(p_owner ‖ q) has no position to average over"
        )
    if name.startswith("top1_same_shift_share"):
        return (
            "no measured position has both experts of a pair shifting the base's top-1 token, so the share of "
            "such positions where they shift to the same token is 0/0"
        )
    if name.startswith("delta_norm_ratio"):
        return (
            "in every pair one expert's centred delta is 0 at every weighted token (it equals the base up to a "
            "shift), so the ratio of the delta norms is unbounded"
        )
    if name == "projective_error_active_max":
        return f"no expert is active (KL(p_i ‖ p_b) > ε = {settings.epsilon}) at any measured position"
    if name.startswith("mass_overlap_upper"):
        return "the bounds exist only on the top-k union of tokens, not with `full_vocabulary`"
    if name in GAP_STATISTICS[:3]:
        return "no merged model was measured"
    if name in ("interaction_residual_relative", "linearization_error_mean"):
        return "it needs each expert's θ_b + λτ_i model, built only at λ ≠ 1 (and a composed logit change ≠ 0)"
    if name.startswith("parameter_"):
        return "no task vectors were measured (the parameter-space measures are off)"
    if name in INTERFERENCE_STATISTICS:
        return "the experts are not all LoRA adapters: input interference reads each adapter's factors B A"
    if name.startswith("retention_") and "merge" in name and report.get("merge_compose_gap") is None:
        return "no merged model was measured"
    if name.startswith(("retention_", "base_logprob_expert_top1_shifted")):
        return (
            "no expert's top-1 token differs from the base's at any measured position, so there is no position to "
            "read what the merge and the composition keep of it"
        )
    return "the measurement gave no value"


def unlabelled_diagnostics(
    composed: ComposedLM,
    rollouts: list[Mapping[str, torch.Tensor]],
    merged_model: torch.nn.Module | None = None,
    task_vectors: Mapping[str, object] | None = None,
    settings: OverlapSettings | None = None,
    progress: bool = False,
    adapters: tuple[torch.nn.Module, Mapping[str, object]] | None = None,
) -> tuple[dict[str, float | None], dict[str, dict]]:
    """Every diagnostic of the composed model's own rollouts (`mergecompose.analysis.rollout_batches`), flat.

    `merged_model` (the task-arithmetic merge at the composition's weights) gives the merge–compose
    gap; `task_vectors` the parameter-space measures; `adapters`, `(base model, {name: adapter})` for LoRA
    experts, the input interference (`input_interference`; the base model is left as it was). Returns
    `(flat, reports)`: `flatten_report`'s names plus `proxy_owner_statistics`' and `INTERFERENCE_STATISTICS`, and
    the `measure_overlap` summaries by centre (and `input_interference`'s report under "input_interference").
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
    flat.update(dict.fromkeys(INTERFERENCE_STATISTICS))
    if adapters is not None:
        interference = input_interference(adapters[0], adapters[1], rollouts)
        reports["input_interference"] = interference
        flat["lora_input_interference_mean"] = interference["mean"]
        flat["lora_input_interference_max"] = interference["max"]
    return flat, reports


# ---------------------------------------------------------------------------------------------
# The verdict rule


class Threshold(BaseModel):
    """`feature >= threshold` (direction "above") or `feature < threshold` ("below") predicts success."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    feature: str | None = None  # None: a constant prediction, `constant`
    threshold: float | None = None
    direction: Literal["above", "below"] = "above"
    constant: bool | None = None
    training_accuracy: float | None = None

    @model_validator(mode="after")
    def _complete(self) -> Threshold:
        if self.feature is not None and self.threshold is None:
            raise ValueError(f"`threshold` is needed with `feature` {self.feature!r}, got none")
        if self.feature is None and self.constant is None:
            raise ValueError("a threshold gives `feature` and `threshold`, or `constant` (true or false); got neither")
        return self

    def outcome(self, diagnostics: Mapping[str, float | None]) -> bool | None:
        """The prediction, or None where the diagnostic it reads is undefined here (None or NaN)."""
        if self.feature is None:
            return bool(self.constant)
        value = diagnostics.get(self.feature)
        if is_undefined(value):
            return None
        above = value >= self.threshold
        return above if self.direction == "above" else not above

    def predict(self, diagnostics: Mapping[str, float | None]) -> bool:
        """The prediction; a ValueError where the diagnostic it reads is undefined (see `outcome`)."""
        outcome = self.outcome(diagnostics)
        if outcome is None:
            raise ValueError(
                f"the rule needs diagnostic {self.feature!r}, which these diagnostics lack "
                f"(got {diagnostics.get(self.feature)!r})"
            )
        return outcome

    def describe(self, diagnostics: Mapping[str, float | None] | None = None) -> str:
        if self.feature is None:
            return f"always {'succeeds' if self.constant else 'fails'} (one outcome in the training settings)"
        sign = "≥" if self.direction == "above" else "<"
        text = f"succeeds when {self.feature} {sign} {self.threshold:.4g}"
        if diagnostics is not None:
            outcome = self.outcome(diagnostics)
            if outcome is None:
                text += f"; here {self.feature} is undefined → unknown"
            else:
                text += f"; here {self.feature} = {diagnostics[self.feature]:.4g} → {'yes' if outcome else 'no'}"
        return text


class VerdictRule(BaseModel):
    """Three thresholds: does plain composition succeed, does the best merge, does the gated composition.

    The verdict: `either` when composition and merge both succeed; `compose` / `merge` when only
    one does; `compose+gate` when neither does but the remedy does; else `neither`.

    A diagnostic that is undefined on the data (None, e.g. the single-active projective error
    where no position has at most one active expert) leaves its threshold's answer unknown. The
    verdict is then the one every answer it could have gives (`possible_verdicts`), so an unknown
    remedy does not matter once composition or the merge succeeds; where they differ the verdict
    is `UNDECIDED` ("undecided") and `recommend` lists the verdicts still possible and why the
    diagnostic is undefined. It never guesses a value for the missing diagnostic.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    compose: Threshold
    merge: Threshold
    remedy: Threshold
    success_threshold: float = Field(0.9, ge=0, le=1)
    heldout_accuracy: float | None = None
    n_settings: int | None = None
    sweep: dict = Field(default_factory=dict)  # which sweep fitted it: name, version, config hash
    # Its accuracy on real experts against the best constant (`score_on_real_settings`); None: not measured.
    real_settings: RealSettingsScore | None = None

    def features(self) -> dict[str, str]:
        """The diagnostic each part reads: part ("compose", "merge", "remedy") -> name (constant parts left out)."""
        return {part: getattr(self, part).feature for part in RULE_PARTS if getattr(self, part).feature is not None}

    def possible_verdicts(self, diagnostics: Mapping[str, float | None]) -> list[str]:
        """The verdicts these diagnostics allow: one, or several where a diagnostic the rule reads is undefined."""
        compose, merge, remedy = (getattr(self, part).outcome(diagnostics) for part in RULE_PARTS)
        return possible_verdicts(compose, merge, remedy)

    def verdict(self, diagnostics: Mapping[str, float | None]) -> str:
        """One of `VERDICTS`, or `UNDECIDED` where an undefined diagnostic leaves more than one possible."""
        possible = self.possible_verdicts(diagnostics)
        return possible[0] if len(possible) == 1 else UNDECIDED


def combine_verdict(compose: bool, merge: bool, remedy: bool) -> str:
    """One of `VERDICTS` from whether composition, the best merge and the remedy succeed."""
    if compose and merge:
        return "either"
    if compose:
        return "compose"
    if merge:
        return "merge"
    return "compose+gate" if remedy else "neither"


def possible_verdicts(compose: bool | None, merge: bool | None, remedy: bool | None) -> list[str]:
    """`combine_verdict` over every value an unknown (None) answer could take: the verdicts still possible,
    in the order of `VERDICTS`."""
    answers = [(True, False) if value is None else (value,) for value in (compose, merge, remedy)]
    found = {combine_verdict(c, m, r) for c in answers[0] for m in answers[1] for r in answers[2]}
    return [verdict for verdict in VERDICTS if verdict in found]


def load_rule(path: str | os.PathLike | None = None) -> VerdictRule:
    """The rule at `path`, or the one shipped with the package (`analysis/predict_rule.json`).

    A file that is not UTF-8, not JSON or not a rule is a ValueError naming the file and what was expected."""
    expected = (
        "a predict_rule.json as `mergecompose predict-sweep` writes it (a JSON object with compose, merge, remedy)"
    )
    if path is None:
        where = RULE_FILE
        text = resources.files("mergecompose.analysis").joinpath(RULE_FILE).read_text(encoding="utf-8")
    else:
        where, text = str(path), check_text_file(path, "rule").read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"`rule` file {where!r} is not JSON ({error.msg} at line {error.lineno} column {error.colno}); "
            f"expected {expected}"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"`rule` file {where!r} holds a JSON {type(data).__name__}; expected {expected}")
    try:
        return VerdictRule.model_validate(data)
    except ValidationError as error:
        raise ValueError(f"`rule` file {where!r} is not a verdict rule: {validation_message(error)}") from None


def check_rule_diagnostics(rule: VerdictRule, settings: OverlapSettings | None = None, where: str = "`rule`") -> None:
    """Raise a ValueError unless every diagnostic `rule` reads is one the overlap measures with `settings`.

    Cheap, and meant for before any model loads: `diagnostic_names(settings)` says what will be measured.
    """
    settings = settings or OverlapSettings()
    known = diagnostic_names(settings)
    for part, feature in rule.features().items():
        if feature in known:
            continue
        if feature.startswith("coactivation_rate@"):
            raise ValueError(
                f"{where}: `{part}` reads {feature!r}, but co-activation is measured only at `settings.epsilons` "
                f"= {settings.epsilons}; add {feature.removeprefix('coactivation_rate@')} to `epsilons`"
            )
        close = difflib.get_close_matches(feature, known, n=3)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ValueError(
            f"{where}: `{part}` reads diagnostic {feature!r}, which the overlap does not measure{hint} "
            f"The diagnostics: {', '.join(known)}"
        )


def recommend(
    rule: VerdictRule, diagnostics: Mapping[str, float | None], reasons: Mapping[str, str] | None = None
) -> dict:
    """The verdict with its evidence: each threshold, where these diagnostics sit, and the rule's held-out accuracy.

    `reasons` (`undefined_reasons`) say why a diagnostic is undefined; every diagnostic the rule reads
    that is undefined here is listed under `undefined` with its reason, and `possible_verdicts` gives
    the verdicts the defined ones allow (`VerdictRule.verdict`).

    `real_settings` is the rule's score on real experts (`RealSettingsScore`, None where the rule file has none,
    and then `measured_on_real` is False); `decision` is True only where that score is strictly above always
    answering the best constant label: otherwise the verdict is what the rule would say, not a decision.
    """
    reasons = reasons or {}
    undefined = {
        feature: reasons.get(feature, "no value on these data")
        for feature in dict.fromkeys(rule.features().values())
        if is_undefined(diagnostics.get(feature))
    }
    real = rule.real_settings
    return {
        "verdict": rule.verdict(diagnostics),
        "possible_verdicts": rule.possible_verdicts(diagnostics),
        "undefined": undefined,
        "evidence": {part: getattr(rule, part).describe(diagnostics) for part in RULE_PARTS},
        "heldout_accuracy": rule.heldout_accuracy,
        "n_settings": rule.n_settings,
        "sweep": rule.sweep,
        "caveat": "fitted on the toolkit's synthetic tasks (letter replacement, sequential skills) with small models; "
        "a guide for what to measure on your own experts, not a guarantee",
        "diagnostics": dict(diagnostics),
        "real_settings": None if real is None else real.model_dump(mode="json"),
        "measured_on_real": real is not None,
        "decision": real is not None and real.beats_best_constant(),
    }
