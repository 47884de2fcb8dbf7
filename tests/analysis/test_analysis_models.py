"""The diagnostics on real tiny transformers models: the exact linear case, an overlapping case, rollouts."""

from __future__ import annotations

import copy

import pytest
import torch

from mergecompose.analysis import measure_overlap, rollout_batches
from mergecompose.analysis.measure import model_logprobs, rollout_source
from mergecompose.analysis.parameters import pair_parameter_overlap, parameter_overlap, trimmed_masks
from mergecompose.composition import ComposedLM
from mergecompose.merging import TaskVector, merge


def _with_new_lm_head(base, seed: int, scale: float = 0.5):
    """A copy of `base` whose only change is the output layer (lm_head)."""
    torch.manual_seed(seed)
    expert = copy.deepcopy(base)
    with torch.no_grad():
        expert.lm_head.weight.add_(torch.randn_like(expert.lm_head.weight) * scale)
    return expert


def _merged(base, experts, lam: float):
    model = copy.deepcopy(base)
    model.load_state_dict(merge("task_arithmetic", base, experts, lam=lam, progress=False))
    return model


@pytest.fixture(scope="module")
def lm_head_experts(base_model):
    return [_with_new_lm_head(base_model, seed=21), _with_new_lm_head(base_model, seed=22)]


@pytest.mark.parametrize("lam", [1.0, 0.5])
def test_lm_head_only_experts_merge_exactly_to_the_composition(base_model, lm_head_experts, batches, lam):
    """The paper's linear-equivalence claim, exactly: logits linear in the weights ⇒ merge = compose."""
    merged = _merged(base_model, lm_head_experts, lam)
    composed = ComposedLM(base_model, lm_head_experts, weights=[lam, lam])
    batch = batches[0]
    composed_logprobs = composed.logprobs(batch["input_ids"], batch["attention_mask"])  # (B, T, V)
    merged_logprobs = model_logprobs(merged, batch["input_ids"], batch["attention_mask"])
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(merged_logprobs[real], composed_logprobs[real], atol=1e-5, rtol=0)

    scaled = [_merged(base_model, [expert], lam) for expert in lm_head_experts]
    report = measure_overlap(
        composed, batches, merged_model=merged, scaled_expert_models=scaled if lam != 1.0 else None, progress=False
    ).to_dict()
    gap = report["merge_compose_gap"]
    assert gap["kl_mean"] < 1e-6 and gap["kl_max"] < 1e-5
    assert gap["top1_agreement"] == 1.0
    assert gap["interaction_residual_rms"] < 1e-5
    if lam != 1.0:
        for name in composed.expert_names:
            assert report["experts"][name]["linearization_error"] < 1e-6
    # The experts do move the output: the zero gap is not a zero update.
    assert min(report["experts"][name]["kl_mean"] for name in composed.expert_names) > 0.05


def test_experts_changed_in_every_layer_overlap_and_do_not_merge_exactly(base_model, batches):
    """Full-model perturbations: deltas overlap, the composition is not projective, merge ≠ compose."""
    experts = []
    for seed in (31, 32):
        torch.manual_seed(seed)
        expert = copy.deepcopy(base_model)
        with torch.no_grad():
            for parameter in expert.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.1)
        experts.append(expert)
    composed = ComposedLM(base_model, experts)
    merged = _merged(base_model, experts, 1.0)
    task_vectors = {name: TaskVector.from_models(base_model, e) for name, e in zip(composed.expert_names, experts)}
    report = measure_overlap(
        composed, batches, merged_model=merged, task_vectors=task_vectors, progress=False
    ).to_dict()
    pair = report["pairs"]["expert_0|expert_1"]
    assert pair["mass_overlap"] > 0.1
    assert pair["sign_conflict"] > 0.05
    assert report["projective_error"]["per_expert"]["expert_0"] > 1e-3
    assert report["merge_compose_gap"]["kl_mean"] > 1e-3
    assert report["merge_compose_gap"]["interaction_residual_rms"] > 1e-3
    # Independent random updates: near-orthogonal task vectors, chance-level sign conflicts.
    assert abs(pair["parameter"]["cosine"]) < 0.1
    assert 0.3 < pair["parameter"]["ties_sign_conflict"] < 0.7


def test_parameter_overlap_golden():
    tv_1 = TaskVector({"w": torch.tensor([3.0, -2.0, 0.1, 0.5, -4.0])})
    tv_2 = TaskVector({"w": torch.tensor([-1.0, 0.05, 0.2, 3.0, -5.0])})
    # density 0.4: each keeps its 2 largest |τ| over the whole vector: {0, 4} and {3, 4}.
    assert trimmed_masks(tv_1, 0.4)["w"].tolist() == [True, False, False, False, True]
    measures = parameter_overlap({"a": tv_1, "b": tv_2}, density=0.4)["a|b"]
    assert measures["trimmed_mask_jaccard"] == pytest.approx(1 / 3)
    assert measures["ties_sign_conflict"] == 0.0  # both negative at entry 4
    assert measures["cosine"] == pytest.approx(tv_1.cosine(tv_2))
    flipped = TaskVector({"w": torch.tensor([-1.0, 0.05, 0.2, 3.0, 5.0])})
    assert parameter_overlap({"a": tv_1, "b": flipped}, density=0.4)["a|b"]["ties_sign_conflict"] == 1.0
    # A tensor only one task vector has: in the union, never in the intersection.
    masks_1 = {"w": torch.tensor([True, False]), "only_1": torch.tensor([True, True])}
    masks_2 = {"w": torch.tensor([True, True])}
    tensors = {"w": torch.tensor([1.0, 1.0]), "only_1": torch.ones(2)}
    measures = pair_parameter_overlap(tensors, {"w": torch.tensor([-1.0, 1.0])}, masks_1, masks_2)
    assert measures == {"trimmed_mask_jaccard": 1 / 4, "ties_sign_conflict": 1.0}
    with pytest.raises(ValueError, match="`density`"):
        trimmed_masks(tv_1, 0.0)


def test_one_hot_rollout_source_is_the_expert_itself(base_model, expert_models):
    composed = ComposedLM(base_model, expert_models)
    prompt = torch.tensor([[5, 9, 14, 3]])
    for name, model in [("expert_1", expert_models[1]), ("base", base_model)]:
        decoded = rollout_source(composed, name).generate(prompt, max_new_tokens=6, eos_token_id=None)
        reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
        assert decoded.tolist() == reference.tolist()
    assert composed.weights is None  # the original is not modified
    with pytest.raises(ValueError, match="`source`"):
        rollout_source(composed, "nobody")


def test_rollout_batches_measure_generated_positions_only(base_model, expert_models):
    composed = ComposedLM(base_model, expert_models)
    prompts = [
        {"input_ids": torch.tensor([[0, 7, 8], [4, 5, 6]]), "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])}
    ]
    rolled = rollout_batches(composed, prompts, source="composed", max_new_tokens=5, eos_token_id=None)
    batch = rolled[0]
    assert batch["input_ids"].shape == (2, 8)
    # Columns 2..6 produced tokens 3..7; column 7 produced nothing, columns 0..1 are prompt.
    assert batch["measure_mask"].tolist() == [[False, False, True, True, True, True, True, False]] * 2
    assert batch["attention_mask"][0].tolist() == [0, 1, 1, 1, 1, 1, 1, 1]
    report = measure_overlap(composed, rolled, progress=False).to_dict()
    assert report["num_positions"] == 10
    # With an EOS that the first row emits at once, nothing after it is real.
    first_token = int(batch["input_ids"][0, 3])
    rolled = rollout_batches(composed, prompts, source="composed", max_new_tokens=5, eos_token_id=first_token)
    assert rolled[0]["measure_mask"][0].tolist()[2:4] == [True, False]
    assert rolled[0]["attention_mask"][0, 4:].sum().item() == 0
