"""Each expert on its own prompts: the statistics by hand, and the reports against an independent computation on the
tiny models (the base's top-1 agreement and mean log-probability on the expert's own greedy tokens)."""

from __future__ import annotations

import copy

import pytest
import torch

from mergecompose.analysis import rollout_batches
from mergecompose.analysis.own_prompts import (
    OWN_PROMPT_STATISTICS,
    own_expert_measures,
    own_prompt_reports,
    own_prompt_statistics,
)
from mergecompose.composition import ComposedLM


def report(kl_merge, kl_compose, kept_merge, kept_compose, logprob, shift_rate, name="x"):
    retention = {
        "merge": None if kl_merge is None else {"kl_mean": kl_merge, "kept_share": kept_merge},
        "compose": {"kl_mean": kl_compose, "kept_share": kept_compose},
    }
    expert = {"retention": retention, "base_logprob_mean": logprob, "top1_shift_rate": shift_rate}
    return {"experts": {name: expert, "other": {"top1_shift_rate": 0.0}}}


def test_the_statistics_by_hand():
    reports = {
        "a": report(0.5, 0.2, 0.6, 0.9, -1.5, 0.25, name="a"),
        "b": report(0.1, 0.4, 0.8, 0.7, -2.5, 0.5, name="b"),
    }
    flat = own_prompt_statistics(reports, ["a", "b"])
    assert list(flat) == list(OWN_PROMPT_STATISTICS)
    assert flat == pytest.approx(
        {
            "own_retention_kl_max_merge": 0.5,
            "own_retention_kl_max_compose": 0.4,
            "own_retention_kl_max_merge_minus_compose": 0.1,
            "own_retention_kept_min_merge": 0.6,
            "own_retention_kept_min_compose": 0.7,
            "own_retention_kept_min_merge_minus_compose": -0.1,
            "own_base_logprob_min": -2.5,
            "own_base_top1_agreement_min": 0.5,
        }
    )


def test_undefined_values_are_left_out_and_a_missing_expert_makes_all_undefined():
    reports = {
        "a": report(None, None, None, None, -1.0, 0.0, name="a"),  # shifts nothing: no retention, no merge
        "b": report(0.3, 0.2, 0.5, 0.4, -2.0, 0.1, name="b"),
    }
    flat = own_prompt_statistics(reports, ["a", "b"])
    assert flat["own_retention_kl_max_merge"] == 0.3 and flat["own_retention_kept_min_compose"] == 0.4
    assert flat["own_base_top1_agreement_min"] == pytest.approx(0.9)
    assert own_expert_measures("a", reports["a"])["kl_merge"] is None
    assert own_prompt_statistics({"a": reports["a"]}, ["a", "b"]) == dict.fromkeys(OWN_PROMPT_STATISTICS)
    only_a = own_prompt_statistics({"a": reports["a"]}, ["a"])
    assert only_a["own_retention_kl_max_merge_minus_compose"] is None and only_a["own_base_logprob_min"] == -1.0


def test_the_reports_read_each_expert_s_own_greedy_tokens(base_model, expert_models):
    generator = torch.Generator().manual_seed(5)
    batches = {
        name: [{"input_ids": torch.randint(1, 64, (3, 6), generator=generator), "attention_mask": torch.ones(3, 6)}]
        for name in ("first", "second")
    }
    with ComposedLM(copy.deepcopy(base_model), expert_models, [1.0, 1.0], names=["first", "second"]) as composed:
        reports = own_prompt_reports(composed, batches, merged_model=None, max_new_tokens=5)
        for index, name in enumerate(("first", "second")):
            (rolled,) = rollout_batches(composed, batches[name], source=name, max_new_tokens=5)
            ids, measured = rolled["input_ids"], rolled["measure_mask"]
            # The expert's own tokens: its greedy generation from its prompts.
            own = expert_models[index].generate(
                batches[name][0]["input_ids"], do_sample=False, max_new_tokens=5, min_new_tokens=5
            )
            assert torch.equal(ids, own)
            with torch.no_grad():
                base_logprobs = torch.log_softmax(base_model(ids).logits.float(), -1)[:, :-1]
            next_tokens = ids[:, 1:]
            mask = measured[:, :-1]
            agreement = (base_logprobs.argmax(-1) == next_tokens)[mask].float().mean()
            logprob = base_logprobs.gather(-1, next_tokens[..., None])[..., 0][mask].mean()
            measures = own_expert_measures(name, reports[name])
            assert measures["base_top1_agreement"] == pytest.approx(float(agreement), abs=1e-6)
            assert measures["base_logprob"] == pytest.approx(float(logprob), abs=1e-4)
            assert measures["kl_merge"] is None  # no merged model measured
    flat = own_prompt_statistics(reports, ["first", "second"])
    assert flat["own_base_top1_agreement_min"] == min(
        own_expert_measures(n, reports[n])["base_top1_agreement"] for n in ("first", "second")
    )
