"""The reducer protocol: parts joined by `merge_reports`, in order, with a key given twice refused."""

from __future__ import annotations

import copy

import pytest
import torch

from mergecompose.analysis.measured_batch import MeasuredBatch, SequenceBatch
from mergecompose.analysis.overlap_settings import OverlapSettings
from mergecompose.analysis.reducers import merge_reports
from mergecompose.analysis.streaming import OverlapAccumulator


def test_merge_reports_joins_nested_parts_in_order_without_modifying_them():
    parts = [
        ("first", {"count": 3, "experts": {"a": {"kl_mean": 0.5}}, "pairs": {}}),
        ("second", {"experts": {"a": {"top_tokens": [1, 2]}, "b": {"top_tokens": []}}, "gap": None}),
        ("third", {"experts": {"a": {"histogram": {"edges": [0.0], "counts": [1, 0]}}}}),
    ]
    before = copy.deepcopy(parts)
    merged = merge_reports(parts)
    assert merged == {
        "count": 3,
        "experts": {
            "a": {"kl_mean": 0.5, "top_tokens": [1, 2], "histogram": {"edges": [0.0], "counts": [1, 0]}},
            "b": {"top_tokens": []},
        },
        "pairs": {},
        "gap": None,
    }
    assert list(merged) == ["count", "experts", "pairs", "gap"]
    assert list(merged["experts"]["a"]) == ["kl_mean", "top_tokens", "histogram"]
    assert parts == before
    merged["experts"]["a"]["extra"] = 1  # the merged dicts are new ones
    assert parts == before


@pytest.mark.parametrize(
    "second, key",
    [
        ({"experts": {"a": {"kl_mean": 0.7}}}, "experts.a.kl_mean"),  # a number given twice
        ({"experts": {"a": {"kl_mean": {"x": 1}}}}, "experts.a.kl_mean"),  # a number, then a section
        ({"experts": None}, "experts"),  # a section, then a value
        ({"pairs": {"a|b": 1}}, "pairs"),  # None, then a section
    ],
)
def test_merge_reports_refuses_a_key_that_two_reducers_give(second, key):
    first = {"experts": {"a": {"kl_mean": 0.5}}, "pairs": None}
    with pytest.raises(ValueError, match=f"report key `{key}` is given by both FirstReducer and SecondReducer"):
        merge_reports([("FirstReducer", first), ("SecondReducer", second)])


def test_every_reducer_reads_one_kind_of_batch():
    accumulator = OverlapAccumulator(["a", "b"], 16)
    assert {type(reducer).__name__ for reducer in accumulator.reducers} >= {"ActivityReducer", "ExampleReducer"}
    assert all(reducer.reads in (MeasuredBatch, SequenceBatch) for reducer in accumulator.reducers)
    assert len(accumulator.position_reducers) + len(accumulator.sequence_reducers) == len(accumulator.reducers)
    assert accumulator.examples in accumulator.sequence_reducers


def test_report_keys_keep_their_order():
    """overlap.json is written in this order; the reducers' order in the accumulator sets it."""
    generator = torch.Generator().manual_seed(0)
    components = torch.log_softmax(torch.randn(3, 2, 5, 16, generator=generator), -1)  # (k+1, B, T, V)
    merged = torch.log_softmax(torch.randn(2, 5, 16, generator=generator), -1)
    accumulator = OverlapAccumulator(["a", "b"], 16, weights=[0.5, 0.5], settings=OverlapSettings(reservoir_size=2))
    accumulator.update(components, torch.ones(2, 5, dtype=torch.bool), merged=merged, scaled_experts=components[1:])
    report = accumulator.report().to_dict()
    assert list(report) == [
        "num_positions",
        "num_sequences",
        "settings",
        "coactivation_rate",
        "coactivation_by_epsilon",
        "active_count_distribution",
        "experts",
        "pairs",
        "projective_error",
        "merge_compose_gap",
        "heatmap",
        "reservoir",
        "vocabulary",
        "retention",
    ]
    assert list(report["experts"]["a"]) == [
        "kl_mean",
        "kl_max",
        "kl_median",
        "active_fraction",
        "active_fraction_by_epsilon",
        "top1_shift_rate",
        "sequences_active_fraction",
        "interval_length_mean",
        "projective_error",
        "projective_error_max",
        "projective_error_active",
        "top_tokens",
        "kl_histogram",
        "linearization_error",
        "linearization_error_max",
        "retention",
        "base_logprob_mean",
        "base_logprob_mean_shifted",
    ]
    assert list(report["pairs"]["a|b"]) == [
        "mass_overlap",
        "sign_conflict",
        "sign_conflict_overlap",
        "support_jaccard",
        "coactivation_rate",
        "mass_overlap_coactive_mean",
        "delta_norm_ratio",
        "mass_overlap_bounds",
        "top1_both_shift_rate",
        "top1_same_shift_share",
        "interval_overlap_rate",
        "interval_iou_mean",
    ]
    assert list(report["projective_error"]) == [
        "single_active",
        "single_active_fraction",
        "single_active_p95",
        "dominant_shift",
        "dominant_shift_fraction",
        "per_expert",
    ]
