"""merge_checkpoints (mergekit's run_merge on disk) against our in-memory merge in mergekit mode;
atomic writes, overwrite, the typed config; merge(..., out_dir=...)."""

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mergecompose.merging import MERGEKIT_MODE, CheckpointMergeConfig, TaskVector, merge, merge_checkpoints

WEIGHTS = [0.7, 0.4]


def _state_dicts(root):
    base = load_file(str(root / "base" / "model.safetensors"))
    experts = [load_file(str(root / f"expert_{index}" / "model.safetensors")) for index in range(2)]
    return base, experts


def _max_abs_difference(folder, expected):
    written = load_file(str(folder / "model.safetensors"))
    assert set(written) == set(expected)
    return max((written[name] - expected[name]).abs().max().item() for name in expected)


@pytest.mark.parametrize(
    "method, params",
    [
        ("ties", {"density": 0.3, "lam": 1.2}),
        ("task_arithmetic", {"lam": 0.8}),
        ("ties", {"density": 0.5, "normalize": False}),
    ],
)
def test_mergekit_on_disk_equals_in_memory_mergekit_mode(checkpoints, tmp_path, method, params):
    config = CheckpointMergeConfig(
        method=method,
        base=str(checkpoints / "base"),
        experts=[{"path": str(checkpoints / f"expert_{i}"), "weight": w} for i, w in enumerate(WEIGHTS)],
        **params,
    )
    out_dir = merge_checkpoints(config, tmp_path / "merged")
    base, experts = _state_dicts(checkpoints)
    in_memory = merge(method, base, experts, weights=WEIGHTS, progress=False, **params, **MERGEKIT_MODE)
    difference = _max_abs_difference(out_dir, in_memory)
    print(f"\nmergekit on disk vs merge(..., **MERGEKIT_MODE): {method} {params}: max abs difference {difference:.3g}")
    assert difference <= 1e-6
    assert _max_abs_difference(out_dir, base) > 1e-2  # a real merge, not the base
    # The paper's definition (global trim, paper consensus) is a different merge.
    if method == "ties":
        paper = merge(method, base, experts, weights=WEIGHTS, progress=False, **params)
        assert _max_abs_difference(out_dir, paper) > 1e-3


def test_mergekit_yaml_is_taken_unchanged_and_output_loads(checkpoints, tmp_path):
    mergekit_config = {
        "merge_method": "ties",
        "base_model": str(checkpoints / "base"),
        "models": [
            {"model": str(checkpoints / f"expert_{i}"), "parameters": {"weight": w, "density": 0.4}}
            for i, w in enumerate(WEIGHTS)
        ],
        "parameters": {"lambda": 1.1},
        "dtype": "float32",
    }
    path = tmp_path / "ties.yaml"
    path.write_text(yaml.safe_dump(mergekit_config))
    out_dir = merge_checkpoints(path, tmp_path / "merged")
    model = AutoModelForCausalLM.from_pretrained(out_dir)
    base, experts = _state_dicts(checkpoints)
    in_memory = merge("ties", base, experts, weights=WEIGHTS, density=0.4, lam=1.1, progress=False, **MERGEKIT_MODE)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, in_memory[name], atol=1e-6, rtol=0)
    assert (out_dir / "mergekit_config.yml").exists()


def test_typed_config_is_translated_and_recorded(checkpoints, tmp_path):
    config = {
        "method": "dare_ties",
        "base": str(checkpoints / "base"),
        "experts": [str(checkpoints / "expert_0"), {"path": str(checkpoints / "expert_1"), "weight": 0.5}],
        "drop_rate": 0.25,
        "seed": 3,
    }
    translated = CheckpointMergeConfig.model_validate(config).to_mergekit()
    assert translated["models"][1] == {
        "model": str(checkpoints / "expert_1"),
        "parameters": {"weight": 0.5, "density": 0.75},
    }
    assert translated["parameters"] == {"lambda": 1.0, "normalize": False, "rescale": True}
    out_dir = merge_checkpoints(config, tmp_path / "dare")
    recorded = yaml.safe_load((out_dir / "mergecompose_config.yaml").read_text())
    assert recorded["method"] == "dare_ties" and recorded["drop_rate"] == 0.25
    with pytest.raises(ValueError, match=r"`drop_rate` must be in \[0, 1\), got 1.5"):
        CheckpointMergeConfig.model_validate({**config, "drop_rate": 1.5}).to_mergekit()
    with pytest.raises(ValueError, match=r"method"):
        CheckpointMergeConfig.model_validate({**config, "method": "magnitude_prune"})


def test_existing_out_dir_is_refused_unless_overwrite(checkpoints, tmp_path):
    config = CheckpointMergeConfig(
        method="task_arithmetic", base=str(checkpoints / "base"), experts=[str(checkpoints / "expert_0")]
    )
    out_dir = tmp_path / "merged"
    out_dir.mkdir()
    (out_dir / "old.txt").write_text("old")
    with pytest.raises(FileExistsError, match=r"already exists; pass overwrite=True"):
        merge_checkpoints(config, out_dir)
    assert (out_dir / "old.txt").exists()
    merge_checkpoints(config, out_dir, overwrite=True)
    assert not (out_dir / "old.txt").exists() and (out_dir / "model.safetensors").exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["merged"]  # no temporary folders left


def test_a_failed_merge_leaves_nothing(checkpoints, tmp_path):
    from mergecompose.core.tiny import random_llama, tiny_llama_config

    random_llama(tiny_llama_config(hidden_size=16, num_heads=2), seed=0).save_pretrained(tmp_path / "other_shape")
    config = {
        "merge_method": "task_arithmetic",
        "base_model": str(checkpoints / "base"),
        "models": [{"model": str(tmp_path / "other_shape"), "parameters": {"weight": 1.0}}],
    }
    # Refused before mergekit runs, naming the tensor, both shapes and both folders.
    with pytest.raises(
        ValueError,
        match=(
            r"shape mismatch for tensor `.*`: `base_model` .*base' has \(64, 32\), "
            r"`models\[0\]\.model` .*other_shape' has \(64, 16\)"
        ),
    ):
        merge_checkpoints(config, tmp_path / "merged")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["other_shape"]

    config["models"][0]["model"] = str(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"`models\[0\]\.model` '.*missing': no such folder"):
        merge_checkpoints(config, tmp_path / "merged")

    # A failure after mergekit has written into the temporary folder: a result that overflows float32.
    config["models"][0]["model"] = str(checkpoints / "expert_0")
    config["parameters"] = {"lambda": 1e30}
    config["models"][0]["parameters"] = {"weight": 1e30}
    with pytest.raises(ValueError, match=r"the merged model has non-finite weights: tensor `.*` .*overflowed"):
        merge_checkpoints(config, tmp_path / "merged")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["other_shape"]


def test_in_memory_merge_writes_a_loadable_model(base_model, expert_models, tmp_path):
    out_dir = tmp_path / "ties"
    merged = merge("ties", base_model, expert_models, density=0.2, out_dir=out_dir, progress=False)
    model = AutoModelForCausalLM.from_pretrained(out_dir)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, merged[name])
    settings = yaml.safe_load((out_dir / "merge_settings.yaml").read_text())["settings"]
    assert settings["method"] == "ties" and settings["trim_scope"] == "global" and settings["consensus"] == "paper"
    with pytest.raises(FileExistsError):
        merge("ties", base_model, expert_models, density=0.2, out_dir=out_dir, progress=False)
    merge("linear", base_model.state_dict(), expert_models, out_dir=tmp_path / "sd", progress=False)
    assert set(load_file(str(tmp_path / "sd" / "model.safetensors"))) == set(base_model.state_dict())


def test_example_configs_describe_the_same_merge():
    from pathlib import Path

    from mergekit.config import MergeConfiguration

    from mergecompose.merging.checkpoints import load_merge_config

    configs = Path(__file__).resolve().parents[2] / "configs"
    ours, typed = load_merge_config(configs / "merge_ties.yaml")
    theirs, untyped = load_merge_config(configs / "merge_ties_mergekit.yaml")
    assert typed is not None and untyped is None
    assert MergeConfiguration.model_validate(ours) == MergeConfiguration.model_validate(theirs)


def test_a_base_plus_adapter_reference_merges_the_adapter_in_first(checkpoints, lora_dirs, base_model, tmp_path):
    """mergekit's `base+adapter` model reference (the quick start's merge): mergekit needs a cache folder for the
    adapter merged into its base, which `merge_checkpoints` gives it; the result is the base plus each ΔW."""
    base = str(checkpoints / "base")
    config = {
        "merge_method": "task_arithmetic",
        "base_model": base,
        "models": [{"model": f"{base}+{lora_dirs[name]}", "parameters": {"weight": 1.0}} for name in ("ab", "cd")],
        "dtype": "float32",
    }
    out = merge_checkpoints(config, tmp_path / "merged")
    merged = load_file(out / "model.safetensors")
    expected = base_model.state_dict()
    for name in ("ab", "cd"):
        expected = TaskVector.from_lora(base_model, lora_dirs[name]).apply_to(expected)
    assert merged.keys() <= expected.keys() and "model.layers.0.self_attn.q_proj.weight" in merged
    for key, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[key], rtol=1e-5, atol=1e-6)
    assert [path.name for path in tmp_path.iterdir()] == ["merged"]  # the adapters' cache is gone
