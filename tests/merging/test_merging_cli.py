"""`mergecompose merge` and `mergecompose task-vector` on tiny checkpoints."""

import json

import pytest
import yaml
from safetensors.torch import load_file

from mergecompose.cli import main
from mergecompose.core.tiny import task_arithmetic_mergekit_config
from mergecompose.merging import MERGEKIT_MODE, TaskVector, merge


def test_merge_command_takes_mergekit_yaml(checkpoints, tmp_path, capsys):
    config = task_arithmetic_mergekit_config(checkpoints)
    path = tmp_path / "merge.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["merge", str(path), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "task_arithmetic" in printed and "model.safetensors" in printed and "21 tensors, F32" in printed
    base = load_file(str(checkpoints / "base" / "model.safetensors"))
    experts = [load_file(str(checkpoints / f"expert_{i}" / "model.safetensors")) for i in range(2)]
    expected = merge("task_arithmetic", base, experts, weights=[0.5, 0.5], lam=0.9, progress=False, **MERGEKIT_MODE)
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert max((written[name] - expected[name]).abs().max().item() for name in expected) <= 1e-6

    assert main(["merge", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["merge", str(path), "--out", str(tmp_path / "out"), "--overwrite"]) == 0


def test_task_vector_command_prints_norms_and_cosines(checkpoints, lora_dirs, base_model, tmp_path, capsys):
    json_path = tmp_path / "figures" / "task_vectors.json"
    arguments = [
        "task-vector",
        str(checkpoints / "base"),
        str(checkpoints / "expert_0"),
        str(checkpoints / "expert_1"),
        str(lora_dirs["ab"]),
        "--out",
        str(tmp_path / "figures"),
    ]
    assert main(arguments) == 0
    printed = capsys.readouterr().out
    assert "per-layer norms" in printed and "model.layers.1" in printed and "cosine" in printed
    figures = json.loads(json_path.read_text())
    first = TaskVector.from_checkpoints(checkpoints / "base", checkpoints / "expert_0")
    second = TaskVector.from_checkpoints(checkpoints / "base", checkpoints / "expert_1")
    adapter = TaskVector.from_lora(base_model, lora_dirs["ab"])
    assert figures["task_vectors"]["expert_0"]["norm"] == pytest.approx(first.norm())
    assert figures["task_vectors"]["ab"]["norm"] == pytest.approx(adapter.norm())
    assert figures["cosine"]["expert_0"]["expert_1"] == pytest.approx(first.cosine(second))
    assert figures["cosine"]["ab"]["expert_1"] == pytest.approx(adapter.cosine(second))
    layer_norms = figures["task_vectors"]["expert_1"]["layer_norms"]
    assert layer_norms["model.layers.0"] == pytest.approx(second.layer_norms()["model.layers.0"])
    assert f"{first.norm():.5g}" in printed


def test_task_vector_command_reports_bad_folders(checkpoints, tmp_path, capsys):
    assert main(["task-vector", str(checkpoints / "base"), str(tmp_path)]) == 2
    assert "it has no config.json and no adapter_config.json (the folder is empty)" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")  # a model folder without safetensors weights
    assert main(["task-vector", str(checkpoints / "base"), str(tmp_path)]) == 2
    assert "no model.safetensors" in capsys.readouterr().err
