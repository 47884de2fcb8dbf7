"""NaN and inf weights are refused by default and merged only when asked (`allow_nonfinite`); where a
value is local or a hub id (`mergecompose.core.sources`)."""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from mergecompose.cli import main
from mergecompose.core.sources import is_local, source_kind
from mergecompose.merging import TaskVector, merge, merge_checkpoints

BROKEN = "model.layers.0.mlp.up_proj.weight"


def _with_nan(state: dict) -> dict:
    state = {name: tensor.clone() for name, tensor in state.items()}
    state[BROKEN].view(-1)[0] = float("nan")
    return state


def test_allow_nonfinite_merges_nan_and_keeps_it_where_it_was(base_model, expert_models):
    expert = _with_nan(expert_models[0].state_dict())
    with pytest.raises(ValueError, match=f"non-finite weights: tensor `{BROKEN}`"):
        merge("task_arithmetic", base_model, [expert], progress=False)
    merged = merge("task_arithmetic", base_model, [expert], allow_nonfinite=True, progress=False)
    assert math.isnan(merged[BROKEN].view(-1)[0]) and torch.isfinite(merged[BROKEN].view(-1)[1:]).all()
    clean = merge("task_arithmetic", base_model, [expert_models[0]], progress=False)
    assert all(torch.equal(merged[name], clean[name]) for name in clean if name != BROKEN)


def test_task_vector_refuses_nan_unless_allowed(base_model, expert_models):
    expert = _with_nan(expert_models[0].state_dict())
    with pytest.raises(ValueError, match=f"finetuned has non-finite weights: tensor `{BROKEN}`.* 1 NaN and 0 inf"):
        TaskVector.from_state_dicts(base_model.state_dict(), expert)
    task_vector = TaskVector.from_state_dicts(base_model.state_dict(), expert, allow_nonfinite=True)
    assert torch.isnan(task_vector.tensors[BROKEN]).sum() == 1


def test_an_overflowing_merge_is_refused_and_allowed_on_request(base_model, expert_models):
    with pytest.raises(ValueError, match="merged model has non-finite weights.*overflowed"):
        merge("task_arithmetic", base_model, expert_models, lam=1e30, weights=[1e30, 1e30], progress=False)
    merged = merge(
        "task_arithmetic",
        base_model,
        expert_models,
        lam=1e30,
        weights=[1e30, 1e30],
        allow_nonfinite=True,
        progress=False,
    )
    assert not torch.isfinite(merged[BROKEN]).all()


def test_merge_command_allow_nonfinite(checkpoints, tmp_path, capsys):
    folder = tmp_path / "nan_expert"
    folder.mkdir()
    for path in (checkpoints / "expert_0").iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    save_file(
        _with_nan(load_file(str(folder / "model.safetensors"))),
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config = {
        "merge_method": "task_arithmetic",
        "base_model": str(checkpoints / "base"),
        "models": [{"model": str(folder), "parameters": {"weight": 1.0}}],
        "dtype": "float32",
    }
    (tmp_path / "merge.yaml").write_text(yaml.safe_dump(config))
    arguments = ["merge", str(tmp_path / "merge.yaml"), "--out", str(tmp_path / "out"), "--quiet"]
    assert main(arguments) == 2
    assert "--allow-nonfinite" in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert main(arguments + ["--allow-nonfinite"]) == 0
    merged = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.isnan(merged[BROKEN]).sum() == 1
    assert main(["task-vector", str(checkpoints / "base"), str(folder), "--quiet", "--allow-nonfinite"]) == 0


def test_mergekit_yaml_with_gradients_filters_and_string_numbers_passes(checkpoints, tmp_path):
    """What mergekit accepts and is valid by our rules goes through.

    Gradient lists, filters, and `1e-1` read as a string.
    """
    config = {
        "merge_method": "ties",
        "base_model": str(checkpoints / "base"),
        "models": [
            {"model": str(checkpoints / "expert_0"), "parameters": {"weight": "1e-1", "density": [0.2, 0.8]}},
            {
                "model": str(checkpoints / "expert_1"),
                "parameters": {"weight": 0.5, "density": [{"filter": "mlp", "value": 0.3}, {"value": 0.6}]},
            },
        ],
        "parameters": {"lambda": 1.0, "normalize": True},
        "dtype": "float32",
    }
    out = merge_checkpoints(config, tmp_path / "out", options={"quiet": True})
    assert (out / "model.safetensors").exists()


def test_local_values_and_hub_ids(tmp_path, monkeypatch, checkpoints, lora_dirs):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert is_local("./x") and is_local("~/x") and is_local("/x") and is_local("a/b/c") and is_local(".hidden")
    assert is_local("runs/missing")  # its parent folder exists
    assert not is_local("owner/name") and not is_local("gpt2")
    assert source_kind(str(checkpoints / "base"), "base") == "checkpoint"
    assert source_kind(str(lora_dirs["ab"]), "expert") == "adapter"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set but the hub cache does not hold it"):
        source_kind("mergecompose-tests/not-cached", "expert")


@pytest.mark.parametrize("scalar", [math.nan, math.inf, -math.inf])
def test_a_task_vector_times_a_non_finite_scalar_is_refused(base_model, expert_models, scalar):
    tau = TaskVector.from_models(base_model, expert_models[0])
    for product in (lambda: tau * scalar, lambda: scalar * tau):
        with pytest.raises(ValueError, match=r"must be a finite real number, got (nan|inf|-inf)"):
            product()
    assert (tau * 0.5).norm() == pytest.approx(0.5 * tau.norm())


def test_a_task_vector_times_a_scalar_that_overflows_it_is_refused(base_model, expert_models):
    tau = TaskVector.from_models(base_model, expert_models[0])
    for product in (lambda: tau * 1e300, lambda: 1e300 * tau, lambda: tau * -1e39):
        with pytest.raises(ValueError, match=r"must keep it finite, got -?1e\+(300|39): tensor `.*` \(.*\) overflows"):
            product()
    assert torch.isfinite((tau * 1e30).tensors[BROKEN]).all()  # large, still finite in float32


def test_nan_already_in_a_task_vector_is_kept_by_a_finite_product(base_model, expert_models):
    tau = TaskVector.from_state_dicts(
        base_model.state_dict(), _with_nan(expert_models[0].state_dict()), allow_nonfinite=True
    )
    assert torch.isnan((tau * 2.0).tensors[BROKEN]).sum() == 1
