"""Each expert on its own task: how the merge and the composition keep it, and how well the base knows its answers.

Expert i's own prompts (its own task's inputs, no joint item) are rolled out greedily by expert i alone and the
rollouts are measured through every model (`measure_overlap`), so that at every position expert i's top-1 token is
the token it generated. From expert i's report on its own rollouts:

* `R_i(merge)`, `R_i(compose)`: `retention[...]["kl_mean"]`, the mean `KL(p_i ‖ p_r)` where expert i shifts the
  base's top-1 token; `K_i(merge)`, `K_i(compose)`: `kept_share`, the share of those positions where system r keeps
  expert i's token (`mergecompose.analysis.retention`);
* `L_i = base_logprob_mean`: the base's mean log-probability of expert i's own greedy tokens;
* `A_i = 1 − top1_shift_rate`: the share of expert i's own greedy tokens that are also the base's top-1.

`own_prompt_statistics` reduces them over the experts to the skill most lost and the answers least known:

    own_retention_kl_max_r  = max_i R_i(r)          own_retention_kept_min_r = min_i K_i(r)       (r = merge, compose)
    own_retention_kl_max_merge_minus_compose   = own_retention_kl_max_merge − own_retention_kl_max_compose
    own_retention_kept_min_merge_minus_compose = own_retention_kept_min_merge − own_retention_kept_min_compose
    own_base_logprob_min = min_i L_i                own_base_top1_agreement_min = min_i A_i

An expert whose value is undefined (it shifts no position on its own prompts) is left out of a max or min; a
statistic with no expert left, or an expert without its own prompts, is None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from mergecompose.analysis.measure import measure_overlap, rollout_batches
from mergecompose.analysis.overlap_settings import OverlapSettings
from mergecompose.composition import ComposedLM

OWN_PROMPT_STATISTICS = (
    "own_retention_kl_max_merge",
    "own_retention_kl_max_compose",
    "own_retention_kl_max_merge_minus_compose",
    "own_retention_kept_min_merge",
    "own_retention_kept_min_compose",
    "own_retention_kept_min_merge_minus_compose",
    "own_base_logprob_min",
    "own_base_top1_agreement_min",
)


def _extreme(values: list[float | None], pick) -> float | None:
    defined = [value for value in values if value is not None]
    return pick(defined) if defined else None


def _difference(merge: float | None, compose: float | None) -> float | None:
    return None if merge is None or compose is None else merge - compose


def own_expert_measures(name: str, report: Mapping) -> dict[str, float | None]:
    """Expert `name`'s `R(merge)`, `R(compose)`, `K(merge)`, `K(compose)`, `L` and `A` (module docstring) from the
    overlap report (or its summary) of its own rollouts; None where undefined or not measured."""
    expert = report["experts"][name]
    retention = expert.get("retention") or {}
    merge, compose = retention.get("merge") or {}, retention.get("compose") or {}
    rate = expert.get("top1_shift_rate")
    return {
        "kl_merge": merge.get("kl_mean"),
        "kl_compose": compose.get("kl_mean"),
        "kept_merge": merge.get("kept_share"),
        "kept_compose": compose.get("kept_share"),
        "base_logprob": expert.get("base_logprob_mean"),
        "base_top1_agreement": None if rate is None else 1.0 - rate,
    }


def own_prompt_statistics(reports: Mapping[str, Mapping], experts: list[str]) -> dict[str, float | None]:
    """`OWN_PROMPT_STATISTICS` from `reports`, expert name → the overlap report of that expert's own rollouts, over
    `experts` (all of them: one without a report makes every statistic None, as the worst expert is unknown)."""
    if not experts or any(name not in reports for name in experts):
        return dict.fromkeys(OWN_PROMPT_STATISTICS)
    measures = [own_expert_measures(name, reports[name]) for name in experts]
    flat: dict[str, float | None] = {}
    for measure, kind, pick in (("kl", "max", max), ("kept", "min", min)):
        for system in ("merge", "compose"):
            flat[f"own_retention_{measure}_{kind}_{system}"] = _extreme(
                [m[f"{measure}_{system}"] for m in measures], pick
            )
        flat[f"own_retention_{measure}_{kind}_merge_minus_compose"] = _difference(
            flat[f"own_retention_{measure}_{kind}_merge"], flat[f"own_retention_{measure}_{kind}_compose"]
        )
    flat["own_base_logprob_min"] = _extreme([m["base_logprob"] for m in measures], min)
    flat["own_base_top1_agreement_min"] = _extreme([m["base_top1_agreement"] for m in measures], min)
    return {name: flat[name] for name in OWN_PROMPT_STATISTICS}


def own_prompt_reports(
    composed: ComposedLM,
    own_batches: Mapping[str, Sequence[Mapping[str, torch.Tensor]]],
    merged_model: torch.nn.Module | None,
    settings: OverlapSettings | None = None,
    max_new_tokens: int = 32,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> dict[str, dict]:
    """Expert name → the overlap summary of that expert's greedy rollouts (`rollout_batches(source=name)`) of its own
    prompt batches, measured through the base, every expert, `merged_model` and the composition."""
    reports = {}
    for name, batches in own_batches.items():
        rolled = rollout_batches(
            composed,
            batches,
            source=name,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )
        report = measure_overlap(
            composed, rolled, merged_model=merged_model, settings=settings, description=f"{name}'s own prompts"
        )
        reports[name] = report.summary()
    return reports
