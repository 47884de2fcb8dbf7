"""Retention (`mergecompose.analysis.retention`): which of the merge and the composition keeps each expert's
decisions. Hand-computed sums, every position co-active, an expert that shifts nothing, and the measured batch's
values against a loop over positions with torch's own KL, on both vocabulary paths."""

from __future__ import annotations

import math

import pytest
import torch

from mergecompose.analysis import OverlapSettings
from mergecompose.analysis.measured_batch import MeasuredBatch
from mergecompose.analysis.retention import add_counts, retention_counts, retention_measures
from mergecompose.analysis.retention_reducer import RetentionReducer
from mergecompose.composition.rule import compose_logprobs

# Positions 0..3: the base's top-1, expert 1's and expert 2's.
TOKENS = torch.tensor([[0, 0, 1, 2], [1, 0, 1, 0], [2, 2, 1, 1]])  # s_1 = [1,0,0,1], s_2 = [1,1,0,1]
SYSTEM_KL = torch.tensor(
    [
        [[0.5, 9.0, 9.0, 1.5], [1.0, 2.0, 9.0, 3.0]],  # KL(p_i ‖ m): 9 where i does not shift (left out)
        [[0.1, 9.0, 9.0, 0.3], [0.3, 0.3, 9.0, 0.3]],  # KL(p_i ‖ q)
    ],
    dtype=torch.float64,
)
SYSTEM_TOP1 = torch.tensor([[1, 2, 1, 2], [2, 2, 1, 0]])  # t_m, t_q
BASE_LOGPROB = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-0.5, -1.0, -1.5, -2.0]])  # log p_b(t_i)


def test_retention_by_hand():
    counts = retention_counts(TOKENS, SYSTEM_KL, SYSTEM_TOP1, BASE_LOGPROB)
    assert counts.shifted.tolist() == [2, 3]
    values = retention_measures(counts)
    # R_1(m) = (0.5 + 1.5) / 2, R_2(m) = (1 + 2 + 3) / 3; R_1(q) = (0.1 + 0.3) / 2, R_2(q) = 0.9 / 3.
    assert values.kl_mean.flatten().tolist() == pytest.approx([1.0, 2.0, 0.2, 0.3])
    # Expert 1 shifts at 0 (t_1 = 1) and 3 (t_1 = 0): m keeps position 0, q position 3.
    # Expert 2 shifts at 0, 1 (t_2 = 2) and 3 (t_2 = 1): m keeps position 1, q positions 0 and 1.
    assert values.kept_share.flatten().tolist() == pytest.approx([1 / 2, 1 / 3, 1 / 2, 2 / 3])
    assert values.base_logprob_mean.tolist() == pytest.approx([-2.5, -1.25])
    assert values.base_logprob_mean_shifted.tolist() == pytest.approx([-2.5, -3.5 / 3])


def test_every_position_co_active_and_an_expert_that_shifts_nothing():
    tokens = torch.tensor([[0, 0, 0], [1, 1, 2], [2, 1, 1], [0, 0, 0]])  # experts 1 and 2 shift everywhere
    system_kl = torch.ones(2, 3, 3, dtype=torch.float64) * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    system_top1 = torch.tensor([[1, 1, 1], [2, 1, 1]])
    values = retention_measures(retention_counts(tokens, system_kl, system_top1, torch.zeros(3, 3)))
    assert values.kl_mean[:, :2].flatten().tolist() == pytest.approx([2.0, 2.0, 2.0, 2.0])
    assert values.kept_share[:, :2].flatten().tolist() == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1.0])
    assert all(math.isnan(value) for value in values.kl_mean[:, 2].tolist() + values.kept_share[:, 2].tolist())
    assert math.isnan(float(values.base_logprob_mean_shifted[2])) and float(values.base_logprob_mean[2]) == 0.0


def test_counts_add_over_batches():
    whole = retention_measures(retention_counts(TOKENS, SYSTEM_KL, SYSTEM_TOP1, BASE_LOGPROB))
    reducer = RetentionReducer(["a", "b"])
    for part in (slice(0, 1), slice(1, 4)):
        counts = retention_counts(TOKENS[:, part], SYSTEM_KL[..., part], SYSTEM_TOP1[:, part], BASE_LOGPROB[:, part])
        reducer.counts = counts if reducer.counts is None else add_counts(reducer.counts, counts)
    report = reducer.report()
    assert report["experts"]["b"]["retention"]["compose"]["kept_share"] == pytest.approx(float(whole.kept_share[1, 1]))
    assert report["retention"]["most_lost"] == pytest.approx(
        {"merge_kl_max": 2.0, "merge_kept_min": 1 / 3, "compose_kl_max": 0.3, "compose_kept_min": 1 / 2}
    )
    assert report["retention"]["merge_minus_compose"] == pytest.approx({"kl_max": 1.7, "kept_min": 1 / 3 - 1 / 2})


@pytest.mark.parametrize(
    ("system_kl", "system_top1", "base_logprob", "message"),
    [
        (torch.zeros(2, 1, 4), SYSTEM_TOP1, BASE_LOGPROB, r"`system_kl` must be \(S, k, n\) = \(S, 2, 4\)"),
        (SYSTEM_KL, SYSTEM_TOP1[:1], BASE_LOGPROB, r"`system_top1` must be \(S, n\) = \(2, 4\)"),
        (SYSTEM_KL, SYSTEM_TOP1, BASE_LOGPROB[:, :3], r"`base_logprob` must be \(k, n\) = \(2, 4\)"),
    ],
)
def test_bad_shapes_are_named(system_kl, system_top1, base_logprob, message):
    with pytest.raises(ValueError, match=message):
        retention_counts(TOKENS, system_kl, system_top1, base_logprob)


@pytest.mark.parametrize("full_vocabulary", [True, False])
def test_the_measured_batch_against_a_loop_with_torch_kl(full_vocabulary):
    torch.manual_seed(0)
    k, n, V = 2, 40, 50
    base = torch.randn(n, V)
    experts = [base + 2.5 * torch.randn(n, V) for _ in range(k)]
    merged = base + 0.8 * (experts[0] - base) + 0.8 * (experts[1] - base)
    components = torch.log_softmax(torch.stack([base, *experts]), -1)
    composed = compose_logprobs(components[0], list(components[1:]), [1.0, 1.0])
    settings = OverlapSettings(full_vocabulary=full_vocabulary, candidates=8)
    batch = MeasuredBatch.measure(components, composed, merged, None, [1.0, 1.0], settings)
    reducer = RetentionReducer(["a", "b"])
    reducer.update(batch)
    report = reducer.report()

    log_m, log_q = torch.log_softmax(merged, -1), torch.log_softmax(composed, -1)
    for index, name in enumerate(["a", "b"]):
        log_p = components[index + 1]
        shifted = log_p.argmax(-1) != components[0].argmax(-1)
        assert 0 < int(shifted.sum()) < n
        for system, log_r in (("merge", log_m), ("compose", log_q)):
            kl = torch.nn.functional.kl_div(log_r, log_p, log_target=True, reduction="none").sum(-1)
            expected = report["experts"][name]["retention"][system]
            assert expected["kl_mean"] == pytest.approx(float(kl[shifted].double().mean()), rel=1e-5)
            kept = (log_r.argmax(-1) == log_p.argmax(-1))[shifted].double().mean()
            assert expected["kept_share"] == pytest.approx(float(kept))
        base_logprob = components[0].gather(-1, log_p.argmax(-1)[:, None])[:, 0].double()
        assert report["experts"][name]["base_logprob_mean"] == pytest.approx(float(base_logprob.mean()), rel=1e-5)
        assert report["experts"][name]["base_logprob_mean_shifted"] == pytest.approx(
            float(base_logprob[shifted].mean()), rel=1e-5
        )


def test_without_a_merge_only_the_composition_is_reported():
    torch.manual_seed(1)
    components = torch.log_softmax(torch.randn(3, 12, 20) * 3, -1)
    composed = compose_logprobs(components[0], list(components[1:]), [1.0, 1.0])
    batch = MeasuredBatch.measure(components, composed, None, None, [1.0, 1.0], OverlapSettings())
    reducer = RetentionReducer(["a", "b"])
    reducer.update(batch)
    report = reducer.report()
    assert report["experts"]["a"]["retention"]["merge"] is None
    assert report["experts"]["a"]["retention"]["compose"]["kl_mean"] is not None
    assert report["retention"]["most_lost"]["merge_kl_max"] is None
    assert report["retention"]["merge_minus_compose"] == {"kl_max": None, "kept_min": None}
