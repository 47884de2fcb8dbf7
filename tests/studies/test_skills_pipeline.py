"""The skills task as a compare task type: settings, training batches, evaluation data, imperfect experts, remedies."""

from __future__ import annotations

import pytest
import torch

from mergecompose.composition import ActivityGate, PlausibilityFilter, TerminationRule
from mergecompose.composition.remedies import RemedySettings
from mergecompose.core.tiny import random_llama, tiny_llama_config
from mergecompose.experiments.compare_config import EvaluationSettings, TrainingSettings
from mergecompose.experiments.formats import IGNORE_INDEX, SequenceFormat
from mergecompose.experiments.tokenizer import build_tokenizer, decode_ids
from mergecompose.experiments.training_strings import is_held_out
from mergecompose.studies.skills.skills_task_type import SkillsTaskSettings, noisy_expert
from mergecompose.studies.skills.spec import find_segments, joint_target, rewrite

SKILLS = [
    {"name": "rev", "open": "[", "close": "]", "transform": "reverse"},
    {"name": "shift", "open": "<", "close": ">", "transform": "shift"},
    {"name": "mirror", "open": "{", "close": "}", "transform": "mirror"},
    {"name": "swap", "open": "(", "close": ")", "transform": "swap_pairs"},
]


def settings(**overrides) -> SkillsTaskSettings:
    fields = {"type": "skills", "skills": SKILLS, "num_experts": 3, "train_lengths": (1, 24), "segment_lengths": (2, 4)}
    fields.update(overrides)
    return SkillsTaskSettings.model_validate(fields)


def sequence_format(tokenizer) -> SequenceFormat:
    return SequenceFormat(
        "seq2seq", "coupled", True, 128, tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.sep_token_id
    )


def test_length_changing_skills_and_the_longest_target():
    dbl = {"name": "dbl", "open": "/", "close": "|", "transform": "double"}
    assert settings(skills=[*SKILLS, dbl]).length_changing() == []  # k = 3: dbl is not composed
    spec = settings(skills=[dbl, *SKILLS])
    assert spec.length_changing() == ["dbl"]
    assert spec.max_target_length(10) == 20 and settings().max_target_length(10) == 10


def test_checkpoint_recipe_does_not_depend_on_k_or_the_analysis():
    assert (
        settings(num_experts=2).data_recipe()
        == settings(num_experts=4, expert_noise=0.5, activity_epsilon=0.3).data_recipe()
    )
    assert settings().data_recipe() != settings(marker_rate=0.3).data_recipe()
    assert settings(num_experts=2).trained_skills() == settings(num_experts=2).joint == ["rev", "shift"]


@pytest.mark.parametrize("skill", [None, "rev"])
def test_training_batches_hold_the_right_targets_and_no_held_out_string(skill):
    spec = settings()
    tokenizer = build_tokenizer(spec.alphabet)
    strings = spec.training_strings(
        skill, tokenizer, sequence_format(tokenizer), TrainingSettings(steps=3, batch_size=32), seed=0
    )
    batches = list(strings)
    assert len(batches) == 3
    applied = [] if skill is None else [skill]
    with_own_marker = 0
    for batch in batches:
        for row in range(batch.input_ids.shape[0]):
            ids = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
            source = decode_ids(tokenizer, ids[: ids.index(tokenizer.eos_token_id)])
            target = decode_ids(tokenizer, batch.labels[row][batch.labels[row] != IGNORE_INDEX].tolist())
            assert not is_held_out(source)
            assert target == rewrite(source, spec, applied).text
            with_own_marker += "[" in source
    # The expert sees its own marker pair in most inputs (own_marker_rate 0.8), the base in about half.
    share = with_own_marker / 96
    assert (0.65 < share < 0.95) if skill else (0.3 < share < 0.7)


def test_eval_data_splits_lengths_targets_and_disjointness():
    spec = settings()
    evaluation = EvaluationSettings(
        joint_size=40, split_size=20, validation_size=10, lengths=[12, 24, 48], length_size=15
    )
    data = spec.eval_data(evaluation, main_length=24, train_max=24)
    assert list(data.test) == ["joint", "only_rev", "only_shift", "only_mirror", "neither", "length_48"]
    assert list(data.validation) == ["joint", "only_rev", "only_shift", "only_mirror", "neither"]
    assert set(data.curves) == {"copy", "joint", "skill:rev", "skill:shift", "skill:mirror"}
    everything = [
        *data.test.values(),
        *data.validation.values(),
        *(s for c in data.curves.values() for s in c.values()),
    ]
    seen: dict[str, str] = {}
    for eval_set in everything:
        for source in eval_set.sources:
            assert len(source) == eval_set.length and is_held_out(source)
            assert (
                seen.setdefault(source, eval_set.name) == eval_set.name
            )  # one set per string (the shared joint aside)
    for name in ["joint", "length_48"]:
        for source, target in zip(data.test[name].sources, data.test[name].targets):
            assert sorted(s.skill for s in find_segments(source, spec.skills)) == ["mirror", "rev", "shift"]
            assert target == joint_target(source, spec).text
    for source, target in zip(data.test["neither"].sources, data.test["neither"].targets):
        assert source == target and find_segments(source, spec.skills) == []
    for source, target in zip(data.curves["copy"][12].sources, data.curves["copy"][12].targets):
        assert source == target
    for source, target in zip(data.curves["skill:shift"][48].sources, data.curves["skill:shift"][48].targets):
        assert "<" in source and target == rewrite(source, spec, ["shift"]).text
    assert data.curves["joint"][24] is data.test["joint"] and data.curves["joint"][48] is data.test["length_48"]


def test_eval_data_refuses_lengths_too_short_for_k_segments():
    with pytest.raises(ValueError, match=r"evaluation lengths \[8\] cannot hold one segment of each of the 3"):
        settings().eval_data(EvaluationSettings(lengths=[8, 24]), main_length=24, train_max=24)


# ------------------------------------------------------------------------------ imperfect experts


def test_noisy_expert_adds_noise_proportional_to_each_tensor_of_the_task_vector():
    config = tiny_llama_config()
    base, expert = random_llama(config, seed=0), random_llama(config, seed=1)
    before = {name: tensor.clone() for name, tensor in expert.state_dict().items()}
    same = noisy_expert(base, expert, 0.0, seed=0)
    for name, tensor in same.state_dict().items():
        assert torch.allclose(tensor, before[name], atol=1e-6)
    noisy = noisy_expert(base, expert, 0.5, seed=0)
    base_state, noisy_state = base.state_dict(), noisy.state_dict()
    for name in ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"]:
        task_vector = before[name] - base_state[name]
        noise = noisy_state[name] - base_state[name] - task_vector
        ratio = (noise.std() / task_vector.pow(2).mean().sqrt()).item()
        assert ratio == pytest.approx(0.5, rel=0.1)
    assert all(torch.equal(tensor, before[name]) for name, tensor in expert.state_dict().items())  # input untouched
    again = noisy_expert(base, expert, 0.5, seed=0).state_dict()
    assert all(torch.equal(again[name], tensor) for name, tensor in noisy_state.items())  # seeded


def test_expert_variant_uses_the_noise_setting():
    config = tiny_llama_config()
    base, expert = random_llama(config, seed=0), random_llama(config, seed=1)
    assert settings().expert_variant(base, expert, "rev") is expert
    changed = settings(expert_noise=0.3).expert_variant(base, expert, "rev")
    assert not torch.equal(changed.state_dict()["lm_head.weight"], expert.state_dict()["lm_head.weight"])


# ------------------------------------------------------------------------------ remedies


def test_remedy_settings_build_the_composition_remedies():
    built = RemedySettings(gate=0.2, plausibility_alpha=0.1, termination="active", termination_threshold=0.3).build(
        eos_token_id=1
    )
    assert built == [
        ActivityGate(0.2),
        PlausibilityFilter(alpha=0.1, top_p=None),
        TerminationRule(1, source="active", threshold=0.3),
    ]
    assert RemedySettings(termination="base").build(7) == [TerminationRule(7, source="base")]
    with pytest.raises(ValueError, match="needs at least one of"):
        RemedySettings()
    with pytest.raises(ValueError):
        RemedySettings(termination="composed")
