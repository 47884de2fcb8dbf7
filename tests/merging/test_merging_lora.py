"""LoRA experts: combined adapters (exact cat, SVD with a stated rank), why peft's linear adapter
combination is not a ΔW merge, and training an expert."""

import copy
import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from mergecompose.core.training import LoraTrainingConfig, train_lora_expert
from mergecompose.merging import TaskVector, combine_lora_adapters


def _relative_error(result: TaskVector, target: TaskVector) -> float:
    return (result - target).norm() / target.norm()


def test_cat_combination_is_exact(base_model, lora_dirs, tmp_path):
    weights = [0.5, -1.5]
    combination = combine_lora_adapters(base_model, lora_dirs, tmp_path / "cat", weights=weights)
    assert combination.relative_error < 1e-6
    assert combination.rank == 8  # 4 + 4
    target = weights[0] * TaskVector.from_lora(base_model, lora_dirs["ab"]) + weights[1] * TaskVector.from_lora(
        base_model, lora_dirs["cd"]
    )
    assert _relative_error(TaskVector.from_lora(base_model, combination.adapter_dir), target) < 1e-6
    assert json.loads((combination.adapter_dir / "combination.json").read_text())["method"] == "cat"


def test_svd_combination_reports_its_error(base_model, lora_dirs, tmp_path):
    target = TaskVector.from_lora(base_model, lora_dirs["ab"]) + TaskVector.from_lora(base_model, lora_dirs["cd"])
    errors = {}
    for rank in (2, 8):
        combination = combine_lora_adapters(base_model, lora_dirs, tmp_path / f"svd{rank}", method="svd", rank=rank)
        measured = _relative_error(TaskVector.from_lora(base_model, combination.adapter_dir), target)
        assert combination.relative_error == pytest.approx(measured, rel=1e-4, abs=1e-6)
        errors[rank] = measured
    assert errors[8] < 1e-5  # rank 8 holds the sum of two rank-4 updates exactly
    assert errors[2] > 0.1  # rank 2 cannot


def test_rslora_adapters_combine_with_scaling_one(base_model, tmp_path):
    directories = {}
    for index, rank in enumerate([4, 2]):
        torch.manual_seed(30 + index)
        config = LoraConfig(
            r=rank, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        )
        get_peft_model(copy.deepcopy(base_model), config).save_pretrained(tmp_path / f"rs{index}")
        directories[f"rs{index}"] = tmp_path / f"rs{index}"
    combination = combine_lora_adapters(base_model, directories, tmp_path / "cat", weights=[1.0, 0.5])
    target = TaskVector.from_lora(base_model, directories["rs0"]) + 0.5 * TaskVector.from_lora(
        base_model, directories["rs1"]
    )
    assert combination.relative_error < 1e-6
    assert _relative_error(TaskVector.from_lora(base_model, combination.adapter_dir), target) < 1e-6


def test_peft_linear_adapter_combination_is_not_a_delta_merge(base_model, tmp_path):
    # peft's "linear" combination averages A and B separately: B A gets cross terms B_i A_j.
    directories = []
    for index in range(2):
        torch.manual_seed(40 + index)
        config = LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False)
        get_peft_model(copy.deepcopy(base_model), config).save_pretrained(tmp_path / f"l{index}")
        directories.append(str(tmp_path / f"l{index}"))
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base_model), directories[0], adapter_name="a")
    peft_model.load_adapter(directories[1], adapter_name="b")
    peft_model.add_weighted_adapter(["a", "b"], [1.0, 1.0], "linear", combination_type="linear")
    module = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    target = module.get_delta_weight("a") + module.get_delta_weight("b")
    error = ((module.get_delta_weight("linear") - target).norm() / target.norm()).item()
    assert error > 0.3
    with pytest.raises(ValueError, match=r"`method` must be 'cat' \(exact\) or 'svd'.*merge A and B separately"):
        combine_lora_adapters(base_model, {"a": directories[0]}, tmp_path / "out", method="linear")


def test_combination_arguments_are_checked(base_model, lora_dirs, tmp_path):
    with pytest.raises(ValueError, match=r"`rank` must be a positive integer for method='svd', got None"):
        combine_lora_adapters(base_model, lora_dirs, tmp_path / "out", method="svd")
    with pytest.raises(ValueError, match=r"`weights` must hold 2 finite numbers"):
        combine_lora_adapters(base_model, lora_dirs, tmp_path / "out", weights=[1.0])
    (tmp_path / "exists").mkdir()
    with pytest.raises(FileExistsError):
        combine_lora_adapters(base_model, lora_dirs, tmp_path / "exists")


def test_train_lora_expert_learns_and_saves_an_adapter(base_model, tmp_path):
    torch.manual_seed(0)
    input_ids = torch.randint(3, 64, (4, 12))
    batches = [{"input_ids": input_ids, "labels": input_ids}]
    config = LoraTrainingConfig(rank=4, steps=25, learning_rate=1e-2, target_modules=["q_proj", "v_proj"])
    before = {name: tensor.clone() for name, tensor in base_model.state_dict().items()}
    training = train_lora_expert(base_model, batches, tmp_path / "expert", config, progress=False)
    assert training.losses[-1] < 0.8 * training.losses[0]
    assert all(torch.equal(tensor, before[name]) for name, tensor in base_model.state_dict().items())
    recorded = json.loads((training.adapter_dir / "training_config.json").read_text())
    assert recorded["config"]["rank"] == 4 and len(recorded["losses"]) == 25
    # The saved adapter reproduces the trained loss.
    loaded = PeftModel.from_pretrained(copy.deepcopy(base_model), str(training.adapter_dir)).eval()
    with torch.no_grad():
        loss = loaded(input_ids=input_ids, labels=input_ids).loss.item()
    assert loss < training.losses[0]
    with pytest.raises(ValueError, match=r"`batches\[0\]` must hold `input_ids` and `labels`"):
        train_lora_expert(base_model, [{"input_ids": input_ids}], tmp_path / "bad", config, progress=False)
