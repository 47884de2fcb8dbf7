"""TaskVector: builders (state dicts, models, safetensors folders, LoRA adapters), algebra, errors."""

import copy
import math

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file

from mergecompose.merging import TaskVector, merge


def test_from_state_dicts_golden_and_skips_integer_buffers():
    base = {"w": torch.tensor([1.0, 2.0]), "steps": torch.tensor([3]), "mask": torch.tensor([True])}
    finetuned = {"w": torch.tensor([1.5, 1.0]), "steps": torch.tensor([9]), "mask": torch.tensor([False])}
    tau = TaskVector.from_state_dicts(base, finetuned)
    assert list(tau.tensors) == ["w"]
    torch.testing.assert_close(tau.tensors["w"], torch.tensor([0.5, -1.0]))


def test_algebra_golden():
    first = TaskVector({"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])})
    second = TaskVector({"a": torch.tensor([1.0, 1.0]), "b": torch.tensor([-1.0])})
    assert first.norm() == pytest.approx(5.0)  # √(9 + 16)
    torch.testing.assert_close((first + second).tensors["a"], torch.tensor([4.0, 1.0]))
    torch.testing.assert_close((first - second).tensors["b"], torch.tensor([5.0]))
    torch.testing.assert_close((-first).tensors["a"], torch.tensor([-3.0, 0.0]))
    torch.testing.assert_close((0.5 * first).tensors["b"], torch.tensor([2.0]))
    torch.testing.assert_close((first * 2).tensors["a"], torch.tensor([6.0, 0.0]))
    torch.testing.assert_close(sum([first, second]).tensors["a"], torch.tensor([4.0, 1.0]))
    # ⟨τ, σ⟩ = 3 − 4 = −1; ‖σ‖ = √3.
    assert first.cosine(second) == pytest.approx(-1.0 / (5.0 * math.sqrt(3.0)))
    assert first.cosine(first * 3.0) == pytest.approx(1.0)
    # A tensor missing on one side counts as zero.
    only_c = TaskVector({"c": torch.tensor([2.0])})
    assert (first + only_c).norm() == pytest.approx(math.sqrt(29.0))
    assert first.cosine(only_c) == 0.0


def test_operations_do_not_modify_operands():
    first = TaskVector({"a": torch.tensor([1.0, 2.0])})
    second = TaskVector({"a": torch.tensor([3.0, 4.0])})
    _ = first + second, first - second, -first, first * 3.0
    assert torch.equal(first.tensors["a"], torch.tensor([1.0, 2.0]))
    assert torch.equal(second.tensors["a"], torch.tensor([3.0, 4.0]))


def test_layer_norms_group_tensors_by_layer():
    tau = TaskVector(
        {
            "model.layers.0.self_attn.q_proj.weight": torch.tensor([3.0]),
            "model.layers.0.mlp.up_proj.weight": torch.tensor([4.0]),
            "model.layers.1.mlp.up_proj.weight": torch.tensor([1.0]),
            "lm_head.weight": torch.tensor([2.0, 0.0]),
        }
    )
    assert tau.layer_norms() == pytest.approx({"model.layers.0": 5.0, "model.layers.1": 1.0, "lm_head.weight": 2.0})


def test_errors_name_the_tensor_and_both_shapes():
    with pytest.raises(ValueError, match=r"`w`: base has shape \(2,\), finetuned has shape \(3,\)"):
        TaskVector.from_state_dicts({"w": torch.zeros(2)}, {"w": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"only in base: \['v'\]; only in finetuned: \['u'\]"):
        TaskVector.from_state_dicts(
            {"w": torch.zeros(2), "v": torch.zeros(1)}, {"w": torch.zeros(2), "u": torch.zeros(1)}
        )
    with pytest.raises(ValueError, match=r"`w`: left operand has shape \(2,\), right operand has shape \(3,\)"):
        TaskVector({"w": torch.zeros(2)}) + TaskVector({"w": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"undefined for a zero task vector"):
        TaskVector({"w": torch.zeros(2)}).cosine(TaskVector({"w": torch.ones(2)}))
    with pytest.raises(ValueError, match=r"real scalar"):
        TaskVector({"w": torch.zeros(2)}) * torch.ones(2)
    with pytest.raises(ValueError, match=r"`base` must be a torch module or a state dict"):
        TaskVector.from_state_dicts([1, 2], {"w": torch.zeros(2)})


def test_from_models_apply_to_round_trip(base_model, expert_models):
    expert = expert_models[0]
    tau = TaskVector.from_models(base_model, expert)
    base_before = {name: tensor.clone() for name, tensor in base_model.state_dict().items()}
    restored = tau.apply_to(base_model.state_dict())
    for name, tensor in expert.state_dict().items():
        torch.testing.assert_close(restored[name], tensor, atol=1e-6, rtol=0)
    model = tau.apply_to(base_model, scale=0.5)
    assert model is not base_model
    for name, tensor in model.state_dict().items():
        expected = base_before[name] + 0.5 * (expert.state_dict()[name] - base_before[name])
        torch.testing.assert_close(tensor, expected, atol=1e-6, rtol=0)
    assert all(torch.equal(tensor, base_before[name]) for name, tensor in base_model.state_dict().items())


def test_from_checkpoints_reads_single_and_sharded_folders(base_model, expert_models, tmp_path):
    base_model.save_pretrained(tmp_path / "base")
    expert_models[0].save_pretrained(tmp_path / "expert", max_shard_size="40KB")
    assert (tmp_path / "expert" / "model.safetensors.index.json").exists()
    from_disk = TaskVector.from_checkpoints(tmp_path / "base", tmp_path / "expert")
    in_memory = TaskVector.from_models(base_model, expert_models[0])
    assert set(from_disk.tensors) == set(in_memory.tensors)
    for name, tensor in in_memory.tensors.items():
        assert torch.equal(from_disk.tensors[name], tensor)
    with pytest.raises(ValueError, match=r"`finetuned` .* is not a model folder: it has no config.json"):
        TaskVector.from_checkpoints(tmp_path / "base", tmp_path)
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"no model.safetensors"):
        TaskVector.from_checkpoints(tmp_path / "base", tmp_path / "no_weights")


# ---- LoRA ----------------------------------------------------------------------------------------


def test_adapter_task_vector_plus_task_arithmetic_is_merge_and_unload(base_model, lora_dirs):
    for adapter_dir in lora_dirs.values():
        tau = TaskVector.from_lora(base_model, adapter_dir)
        merged = merge("task_arithmetic", base_model, [tau], progress=False)
        reference = (
            PeftModel.from_pretrained(copy.deepcopy(base_model), str(adapter_dir)).merge_and_unload().state_dict()
        )
        assert set(merged) == set(reference)
        for name, tensor in reference.items():
            assert torch.equal(merged[name], tensor), name


def _adapter(base_model, tmp_path, name, **config):
    torch.manual_seed(21)
    peft_model = get_peft_model(
        copy.deepcopy(base_model),
        LoraConfig(target_modules=["q_proj", "down_proj"], init_lora_weights=False, **config),
    )
    peft_model.save_pretrained(tmp_path / name)
    return tmp_path / name


@pytest.mark.parametrize("use_rslora, expected_scaling", [(False, 12.0 / 4), (True, 12.0 / 2)])
def test_lora_delta_is_scaling_times_b_a(base_model, tmp_path, use_rslora, expected_scaling):
    # r = 4, alpha = 12: scaling alpha / r = 3, or alpha / √r = 6 with rsLoRA.
    adapter_dir = _adapter(base_model, tmp_path, f"rs{use_rslora}", r=4, lora_alpha=12, use_rslora=use_rslora)
    weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.1.self_attn.q_proj"
    a, b = weights[f"{prefix}.lora_A.weight"], weights[f"{prefix}.lora_B.weight"]  # (r, in), (out, r)
    tau = TaskVector.from_lora(base_model, adapter_dir)
    torch.testing.assert_close(tau.tensors["model.layers.1.self_attn.q_proj.weight"], expected_scaling * b @ a)
    assert len(tau.tensors) == 4  # q_proj and down_proj in 2 layers


def test_lora_from_peft_model_and_modules_to_save(base_model, tmp_path):
    adapter_dir = _adapter(base_model, tmp_path, "saved", r=2, lora_alpha=2, modules_to_save=["lm_head"])
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base_model), str(adapter_dir))
    with torch.no_grad():  # make the saved lm_head copy differ from the base
        peft_model.base_model.model.lm_head.modules_to_save["default"].weight.add_(0.25)
    tau = TaskVector.from_lora(base_model, peft_model)
    torch.testing.assert_close(tau.tensors["lm_head.weight"], torch.full_like(tau.tensors["lm_head.weight"], 0.25))
    merged = tau.apply_to(base_model.state_dict())
    reference = peft_model.merge_and_unload().state_dict()
    for name, tensor in reference.items():
        torch.testing.assert_close(merged[name], tensor, atol=1e-6, rtol=0)


def test_dora_adapter_gets_a_clear_error(base_model, tmp_path):
    adapter_dir = _adapter(base_model, tmp_path, "dora", r=2, lora_alpha=2, use_dora=True)
    with pytest.raises(ValueError, match=r"DoRA adapter, which is not supported.*merge_and_unload"):
        TaskVector.from_lora(base_model, adapter_dir)


def test_adapter_for_another_base_names_the_tensor(tmp_path, lora_dirs):
    from mergecompose.core.tiny import random_llama, tiny_llama_config

    other_base = random_llama(tiny_llama_config(hidden_size=16, num_heads=2), seed=0)
    with pytest.raises(
        ValueError,
        match=(
            r"made for another base: its `\S+lora_A.weight` has shape \(4, \d+\), "
            r"but the base's `\S+` has shape \(\d+, \d+\)"
        ),
    ):
        TaskVector.from_lora(other_base, lora_dirs["ab"])


def test_tied_checkpoint_task_vector_updates_both_tied_names(tmp_path):
    from mergecompose.core.tiny import random_llama, tiny_llama_config

    config = tiny_llama_config()
    config.tie_word_embeddings = True
    base, expert = random_llama(config, seed=0), random_llama(config, seed=1)
    base.save_pretrained(tmp_path / "base")
    expert.save_pretrained(tmp_path / "expert")
    tau = TaskVector.from_checkpoints(tmp_path / "base", tmp_path / "expert")
    assert "lm_head.weight" not in tau.tensors  # a tied checkpoint stores the shared tensor once
    model = random_llama(config, seed=5)
    model.load_state_dict(merge("task_arithmetic", base, [tau], progress=False))
    torch.testing.assert_close(model.lm_head.weight, expert.lm_head.weight, atol=1e-6, rtol=0)
    torch.testing.assert_close(tau.apply_to(base).lm_head.weight, expert.lm_head.weight, atol=1e-6, rtol=0)
