"""The streaming accumulator: equal to the direct computation, independent of chunking, flat memory."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mergecompose.analysis import delta_overlap as ox
from mergecompose.analysis import diagnostics as dx
from mergecompose.analysis import measured_batch
from mergecompose.analysis.overlap_report import json_text
from mergecompose.analysis.overlap_settings import OverlapSettings
from mergecompose.analysis.streaming import OverlapAccumulator
from mergecompose.analysis.summaries import LogHistogram, PositionReservoir
from mergecompose.composition import compose_logprobs


def _components(seed: int, batch: int = 4, seq: int = 6, vocab: int = 16, k: int = 2) -> torch.Tensor:
    torch.manual_seed(seed)
    base = torch.randn(batch, seq, vocab)
    # Per-position scales, so that each expert is active at some positions and not at others.
    experts = [base + torch.randn(batch, seq, vocab) * torch.rand(batch, seq, 1) * scale for scale in (1.0, 2.0)[:k]]
    return torch.log_softmax(torch.stack([base, *experts]), -1)  # (k+1, B, T, V)


def _accumulate(chunks, masks, settings=None, **kwargs) -> dict:
    settings = settings or OverlapSettings(reservoir_size=4)
    accumulator = OverlapAccumulator(["a", "b"], chunks[0].shape[-1], settings=settings, **kwargs)
    for components, mask in zip(chunks, masks):
        accumulator.update(components, mask)
    return accumulator.report().to_dict()


# The top-k union with 64 candidates holds all 16 tokens, so it must give the full computation too.
@pytest.mark.parametrize("full_vocabulary", [True, False])
@pytest.mark.parametrize("centre", ["median", "base_weighted_median"])
def test_pooled_overlap_equals_the_direct_computation_on_all_positions(centre, full_vocabulary):
    components = _components(0)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[0, :2] = False  # padding is not measured
    settings = OverlapSettings(reservoir_size=4, centre=centre, full_vocabulary=full_vocabulary)
    report = _accumulate([components], [mask], settings=settings, chunk_positions=5)
    base, experts = components[0][mask], components[1:][:, mask]  # (N, V), (k, N, V)
    composed = compose_logprobs(base, list(experts))
    centred = ox.centred_deltas(base, experts, centre=centre)
    weight = ox.overlap_weights(base, experts[0], experts[1], composed)
    product = (weight * centred[0].abs() * centred[1].abs()).sum()
    norms = ((weight * centred[0] ** 2).sum() * (weight * centred[1] ** 2).sum()).sqrt()
    conflict = (weight * centred[0].abs() * centred[1].abs())[centred[0] * centred[1] < 0].sum()
    pair = report["pairs"]["a|b"]
    assert pair["mass_overlap"] == pytest.approx(float(product / norms), rel=1e-5)
    assert pair["sign_conflict"] == pytest.approx(float(conflict / product), rel=1e-5)
    activity = dx.expert_activity(base, experts)
    assert report["num_positions"] == 22
    assert report["experts"]["b"]["kl_mean"] == pytest.approx(float(activity[1].mean()), rel=1e-5)
    assert report["coactivation_rate"] == pytest.approx(dx.coactivation_rate(activity, 0.1), abs=1e-9)
    assert report["experts"]["a"]["active_fraction"] == pytest.approx(float((activity[0] > 0.1).float().mean()))
    single, eligible = dx.single_active_error(base, experts, composed, activity > 0.1)
    assert 0 < int(eligible.sum()) < 22 and 0 < int((activity > 0.1).sum()) < 44
    assert report["projective_error"]["single_active"] == pytest.approx(float(single[eligible].mean()), rel=1e-5)
    supports = ox.delta_supports(centred, base, experts, 0.1, 1e-3)
    restricted = dx.restricted_projective_error(base, experts, composed, supports)  # (k, N)
    assert report["experts"]["a"]["projective_error"] == pytest.approx(float(restricted[0].mean()), rel=1e-5)
    active_a = activity[0] > 0.1
    assert report["experts"]["a"]["projective_error_active"] == pytest.approx(
        float(restricted[0][active_a].mean()), rel=1e-5
    )


def test_result_does_not_depend_on_chunking():
    components = _components(1, batch=6)
    mask = torch.rand(6, 6, generator=torch.Generator().manual_seed(0)) > 0.2
    whole = _accumulate([components], [mask])
    split = _accumulate([components[:, :2], components[:, 2:3], components[:, 3:]], [mask[:2], mask[2:3], mask[3:]])
    for key in [
        "num_positions",
        "num_sequences",
        "coactivation_rate",
        "coactivation_by_epsilon",
        "active_count_distribution",
    ]:
        assert whole[key] == pytest.approx(split[key])
    for name in ["a", "b"]:
        for key in [
            "kl_mean",
            "active_fraction",
            "projective_error",
            "interval_length_mean",
            "sequences_active_fraction",
        ]:
            assert whole["experts"][name][key] == pytest.approx(split["experts"][name][key], rel=1e-6)
    assert whole["pairs"]["a|b"]["interval_iou_mean"] is not None
    for key in ["mass_overlap", "sign_conflict", "support_jaccard", "interval_iou_mean"]:
        assert whole["pairs"]["a|b"][key] == pytest.approx(split["pairs"]["a|b"][key], rel=1e-6)


def _state_size(accumulator: OverlapAccumulator) -> int:
    """Number of tensor elements the accumulator and its reducers hold, histograms included."""
    total = 0
    for value in [value for holder in [accumulator, *accumulator.reducers] for value in vars(holder).values()]:
        if isinstance(value, torch.Tensor):
            total += value.numel()
        elif isinstance(value, LogHistogram):
            total += value.counts.numel()
        elif isinstance(value, list) and value and isinstance(value[0], LogHistogram):
            total += sum(h.counts.numel() for h in value)
    return total


def test_memory_is_independent_of_the_number_of_tokens():
    settings = OverlapSettings(reservoir_size=3, heatmap_sequences=2)
    accumulator = OverlapAccumulator(["a", "b"], 16, settings=settings)
    accumulator.update(_components(0), torch.ones(4, 6, dtype=torch.bool))
    after_one = (_state_size(accumulator), len(accumulator.heatmap), len(accumulator.reservoir.samples()))
    for seed in range(1, 20):
        accumulator.update(_components(seed), torch.ones(4, 6, dtype=torch.bool))
    after_many = (_state_size(accumulator), len(accumulator.heatmap), len(accumulator.reservoir.samples()))
    assert after_one == after_many == (after_one[0], 2, 3)
    assert after_one[0] >= 2 * 2 * 16  # the state is seen: at least the two (k, V) vocabulary sums
    assert accumulator.positions == 20 * 24


def test_merged_equal_to_composed_gives_zero_gap_and_residual():
    components = _components(2)
    composed = compose_logprobs(components[0], list(components[1:]))
    accumulator = OverlapAccumulator(["a", "b"], 16)
    accumulator.update(components, torch.ones(4, 6, dtype=torch.bool), merged=composed + 2.0)
    gap = accumulator.report().to_dict()["merge_compose_gap"]
    assert gap["kl_mean"] < 1e-6 and gap["top1_agreement"] == 1.0
    assert gap["interaction_residual_rms"] < 1e-5
    # Another merge: positive gap, consistent with the direct KL.
    other = torch.log_softmax(composed + torch.randn_like(composed), -1)
    accumulator = OverlapAccumulator(["a", "b"], 16)
    accumulator.update(components, torch.ones(4, 6, dtype=torch.bool), merged=other)
    gap = accumulator.report().to_dict()["merge_compose_gap"]
    assert gap["kl_mean"] == pytest.approx(float(dx.kl_divergence(composed, other).mean()), rel=1e-5)
    assert gap["histogram"]["counts"][0] < 24  # not all in the "exactly 0" bin


def test_log_histogram_bins_golden():
    histogram = LogHistogram(low=1e-2, high=1e2, bins_per_decade=1)  # edges 1e-2, 1e-1, 1, 10, 100
    histogram.add(torch.tensor([0.0, 0.005, 0.02, 0.5, 5.0, 50.0, 500.0, math.inf]))
    assert histogram.counts.tolist() == [2, 1, 1, 1, 1, 2]
    assert histogram.quantile(0.25) == pytest.approx(1e-2)
    assert histogram.quantile(1.0) == math.inf


def test_reservoir_keeps_every_item_with_equal_probability():
    size, n, runs = 5, 20, 2000
    kept = torch.zeros(n)
    for run in range(runs):
        reservoir = PositionReservoir(size, seed=run)
        for chunk_start in range(0, n, 7):  # uneven chunks
            chunk = min(7, n - chunk_start)
            for slot, index in reservoir.select(chunk):
                reservoir.store(slot, {"item": chunk_start + index})
        items = [s["item"] for s in reservoir.samples()]
        assert len(items) == size == len(set(items))
        kept[items] += 1
    frequency = kept / runs
    # Each item is kept with probability size/n = 0.25; the binomial s.d. is ≈ 0.0097.
    assert (frequency - size / n).abs().max().item() < 0.04


def test_accumulator_rejects_wrong_shapes():
    accumulator = OverlapAccumulator(["a", "b"], 16)
    with pytest.raises(ValueError, match="`components`"):
        accumulator.update(torch.zeros(2, 4, 6, 16), torch.ones(4, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="`mask`"):
        accumulator.update(_components(0), torch.ones(4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="`merged`"):
        accumulator.update(_components(0), torch.ones(4, 6, dtype=torch.bool), merged=torch.zeros(4, 6, 15))
    with pytest.raises(ValueError, match="`expert_names`"):
        OverlapAccumulator(["a", "a"], 16)
    with pytest.raises(ValueError, match="epsilons"):
        OverlapSettings(epsilons=[-1.0])


def test_heatmap_keeps_activity_and_intervals_of_the_first_sequences():
    torch.manual_seed(3)
    base = torch.log_softmax(torch.randn(2, 7, 16), -1)
    experts = base[None].repeat(2, 1, 1, 1).clone()
    experts[0, :, 2:4] = torch.log_softmax(torch.randn(2, 2, 16) * 3, -1)  # columns [2, 4)
    experts[1, :, 5:7] = torch.log_softmax(torch.randn(2, 2, 16) * 3, -1)  # columns [5, 7)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[0, :2] = False  # row 0: two padding columns, so measured index = column − 2
    accumulator = OverlapAccumulator(["a", "b"], 16, settings=OverlapSettings(heatmap_sequences=2, epsilon=0.01))
    accumulator.update(torch.cat([base[None], experts]), mask, input_ids=torch.arange(14).view(2, 7))
    first, second = accumulator.heatmap
    assert first["intervals"] == [[0, 2], [3, 5]] and second["intervals"] == [[2, 4], [5, 7]]
    assert len(first["activity"][0]) == 5 and first["next_tokens"] == [3, 4, 5, 6, None]
    report = accumulator.report().to_dict()
    assert report["coactivation_rate"] == 0.0
    assert report["pairs"]["a|b"]["interval_overlap_rate"] == 0.0
    assert report["experts"]["a"]["interval_length_mean"] == 2.0
    assert report["projective_error"]["single_active"] < 1e-5


def test_json_never_holds_nan():
    with pytest.warns(
        UserWarning, match=r"r\.json: 2 values were NaN \(undefined\) and are written as null: a\[1\], b\.c"
    ):
        text = json_text({"a": [1.0, float("nan"), float("inf")], "b": {"c": float("nan")}}, "r.json")
    assert json.loads(text) == {"a": [1.0, None, "inf"], "b": {"c": None}}


# ---------------------------------------------------------------------------------------------
# The top-k union (issue 16): cheap by default, complete on request, within the reported bound.


def _peaked_components(seed: int, batch: int = 3, seq: int = 8, vocab: int = 256) -> torch.Tensor:
    """A peaked base (a few tokens hold most of the mass) and two experts that each raise a few tokens
    into their top tokens (so that the large |δ| are in U and the bound can be tight)."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(batch, seq, vocab, generator=generator) * 3.0
    experts = []
    for first, steps in ((0, seq), (8, seq // 2)):  # the second expert acts on the first half of each sequence
        expert = base + 0.05 * torch.randn(batch, seq, vocab, generator=generator)
        expert[:, :steps, first : first + 8] += 6.0 + 2.0 * torch.rand(batch, steps, 8, generator=generator)
        experts.append(expert)
    return torch.log_softmax(torch.stack([base, *experts]), -1)  # (k+1, B, T, V)


def test_top_k_union_agrees_with_the_full_vocabulary_within_the_reported_bound():
    components = _peaked_components(0)
    mask = torch.ones(components.shape[1:3], dtype=torch.bool)
    restricted = _accumulate([components], [mask], settings=OverlapSettings(candidates=24))
    full = _accumulate([components], [mask], settings=OverlapSettings(full_vocabulary=True))
    outside = restricted["vocabulary"]["outside_mass_mean"]
    assert 0 < outside["base"] < 0.2 and restricted["vocabulary"]["candidates"] == 24  # restricted, and not trivially
    assert "vocabulary" not in full and "mass_overlap_bounds" not in full["pairs"]["a|b"]
    low, high = restricted["pairs"]["a|b"]["mass_overlap_bounds"]
    assert low <= full["pairs"]["a|b"]["mass_overlap"] <= high
    assert low <= restricted["pairs"]["a|b"]["mass_overlap"] <= high
    assert high - low < 0.5  # the bound says something
    # Sums over V are computed over V on both paths.
    for name in ("a", "b"):
        assert restricted["experts"][name]["kl_mean"] == pytest.approx(
            full["experts"][name]["kl_mean"], rel=1e-5, abs=1e-7
        )
    assert (
        restricted["projective_error"]["single_active_fraction"]
        == full["projective_error"]["single_active_fraction"]
        > 0
    )
    assert restricted["projective_error"]["single_active"] == pytest.approx(
        full["projective_error"]["single_active"], rel=1e-5, abs=1e-7
    )


def test_union_centre_by_hand_and_its_interval_holds_the_full_centre():
    values = torch.tensor([[3.0, 0.0, 2.0, 1.0]])
    weights = torch.tensor([[0.1, 0.1, 0.3, 0.2]])  # sorted by value: 0.1, 0.2, 0.3, 0.1; 0.3 of the mass is outside
    centre, lower, upper = measured_batch.union_centre(
        values, weights, torch.tensor([0.3]), (torch.tensor([-5.0]), torch.tensor([9.0]))
    )
    # Cumulative 0.1, 0.3, 0.6, 0.7: half of U's 0.7 is reached at 2; below ½ − 0.3 only 0; ½ is reached at 2.
    assert (centre.item(), lower.item(), upper.item()) == (2.0, 0.0, 2.0)
    _, lower, upper = measured_batch.union_centre(
        values, weights, torch.tensor([0.6]), (torch.tensor([-5.0]), torch.tensor([9.0]))
    )
    assert (lower.item(), upper.item()) == (-5.0, 2.0)  # nothing in U is surely below: down to the least δ over V
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        deltas = torch.randn(4, 500, generator=generator)
        probs = torch.softmax(torch.randn(4, 500, generator=generator) * 3, -1)
        keep = probs.topk(40, dim=-1).indices  # (4, 40)
        outside = 1 - probs.gather(-1, keep).sum(-1)
        centre, lower, upper = measured_batch.union_centre(
            deltas.gather(-1, keep), probs.gather(-1, keep), outside, (deltas.amin(-1), deltas.amax(-1))
        )
        full = ox.weighted_median(deltas, probs)
        assert bool(((lower <= full) & (full <= upper) & (lower <= centre) & (centre <= upper)).all())


def test_top_k_union_refuses_components_that_are_not_log_probs():
    components = _components(0) + 1.0  # logits, not log-probs
    accumulator = OverlapAccumulator(["a", "b"], components.shape[-1])
    with pytest.raises(ValueError, match="`components` must be normalised log-probs"):
        accumulator.update(components, torch.ones(components.shape[1:3], dtype=torch.bool))


def test_the_vocabulary_pass_falls_back_to_eager_when_compilation_fails(monkeypatch):
    def broken_compile(function, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler")

        return run

    components = _peaked_components(1)
    mask = torch.ones(components.shape[1:3], dtype=torch.bool)
    eager = _accumulate([components], [mask])
    monkeypatch.setattr(measured_batch, "COMPILE_MIN_VOCAB", 1)
    monkeypatch.setattr(measured_batch, "_compiled", {"function": None, "failed": False})
    monkeypatch.setattr(torch, "compile", broken_compile)
    with pytest.warns(UserWarning, match="torch.compile of the overlap's vocabulary pass failed"):
        fallen_back = _accumulate([components], [mask])
    assert fallen_back["pairs"] == eager["pairs"] and fallen_back["experts"] == eager["experts"]
