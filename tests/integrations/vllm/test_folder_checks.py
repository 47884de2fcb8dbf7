"""`build_vllm_model` reads every tensor of the base and the experts before writing anything: NaN or inf,
a truncated weight file, a tensor of another shape under a matching config.json are refused, naming the
component and the tensor. These run in the main venv: the folder writer does not import vLLM."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mergecompose.analysis.data import char_tokenizer
from mergecompose.cli import main
from mergecompose.core.boundary import InputFileError
from mergecompose.integrations.vllm.folder import build_vllm_model

TENSOR = "model.layers.1.mlp.down_proj.weight"
LORA_TENSOR = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.fixture(scope="module")
def parts(checkpoints, lora_dirs, tmp_path_factory):
    """base/ (the shared tiny base with a tokenizer), full/ (a full expert) and lora/ (an adapter of the base)."""
    root = tmp_path_factory.mktemp("vllm_checks")
    shutil.copytree(checkpoints / "base", root / "base")
    char_tokenizer("abcdefghijklmnopqrstuvwxyz").save_pretrained(root / "base")
    shutil.copytree(checkpoints / "expert_0", root / "full")
    shutil.copytree(lora_dirs["ab"], root / "lora")
    return root


def _edited_copy(parts, name, tmp_path, edit, weights="model.safetensors"):
    """A copy of `parts/name` whose weight file is `edit(state dict)` saved again."""
    folder = tmp_path / f"{name}_edited"
    shutil.copytree(parts / name, folder)
    state = load_file(str(folder / weights))
    edit(state)
    save_file(state, str(folder / weights), metadata={"format": "pt"})
    return folder


def _set_first(tensor_name, value):
    def edit(state):
        state[tensor_name].view(-1)[3] = value

    return edit


def test_nan_in_a_full_expert_is_refused_naming_the_expert_and_the_tensor(parts, tmp_path):
    expert = _edited_copy(parts, "full", tmp_path, _set_first(TENSOR, float("nan")))
    with pytest.raises(ValueError, match=rf"`experts\[1\]` '.*full_edited' has non-finite weights: tensor `{TENSOR}`"):
        build_vllm_model(tmp_path / "out", parts / "base", [parts / "full", expert])
    assert not (tmp_path / "out").exists()


def test_inf_in_the_base_is_refused(parts, tmp_path):
    base = _edited_copy(parts, "base", tmp_path, _set_first(TENSOR, float("-inf")))
    with pytest.raises(ValueError, match=rf"`base` .* tensor `{TENSOR}` \(\d+, \d+\) holds 0 NaN and 1 inf values"):
        build_vllm_model(tmp_path / "out", base, [parts / "full"])
    assert not (tmp_path / "out").exists()


def test_nan_in_a_lora_adapter_is_refused(parts, tmp_path):
    adapter = _edited_copy(parts, "lora", tmp_path, _set_first(LORA_TENSOR, float("nan")), "adapter_model.safetensors")
    with pytest.raises(ValueError, match=rf"`experts\[0\]` .* tensor `{LORA_TENSOR}` .* holds 1 NaN"):
        build_vllm_model(tmp_path / "out", parts / "base", [adapter])


def test_a_tensor_of_another_shape_under_a_matching_config_is_refused(parts, tmp_path):
    def narrower(state):
        state[TENSOR] = state[TENSOR][:, :-1].contiguous()

    expert = _edited_copy(parts, "full", tmp_path, narrower)
    with pytest.raises(ValueError, match=rf"`experts\[0\]` .*: tensor `{TENSOR}` has shape \(32, 63\), the base's"):
        build_vllm_model(tmp_path / "out", parts / "base", [expert])
    assert not (tmp_path / "out").exists()


def test_a_missing_tensor_is_refused(parts, tmp_path):
    expert = _edited_copy(parts, "full", tmp_path, lambda state: state.pop(TENSOR))
    with pytest.raises(ValueError, match=rf"its tensors are not the base's \(missing \['{TENSOR}'\]"):
        build_vllm_model(tmp_path / "out", parts / "base", [expert])


@pytest.mark.parametrize("component", ["base", "full", "lora"])
def test_a_truncated_weight_file_is_refused_naming_the_file(parts, tmp_path, component):
    folder = tmp_path / component
    shutil.copytree(parts / component, folder)
    weights = folder / ("adapter_model.safetensors" if component == "lora" else "model.safetensors")
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    base, experts = (folder, [parts / "full"]) if component == "base" else (parts / "base", [folder])
    argument = "base" if component == "base" else r"experts\[0\]"
    with pytest.raises(
        InputFileError,
        match=rf"`{argument}` '{re.escape(str(weights))}': has \d+ bytes, its header describes \d+ \(truncated",
    ):
        build_vllm_model(tmp_path / "out", base, experts)
    assert not (tmp_path / "out").exists()


def test_the_command_refuses_nan_in_one_line(parts, tmp_path, capsys):
    expert = _edited_copy(parts, "full", tmp_path, _set_first(TENSOR, float("inf")))
    before = (expert / "model.safetensors").read_bytes()
    argv = ["vllm-model", "--base", str(parts / "base"), "--expert", str(expert), "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("mergecompose vllm-model: error: `experts[0]`") and len(err.strip().splitlines()) == 1
    assert f"tensor `{TENSOR}`" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and (expert / "model.safetensors").read_bytes() == before


def test_clean_components_still_build(parts, tmp_path):
    out = build_vllm_model(tmp_path / "out", parts / "base", [parts / "full", parts / "lora"])
    assert (out / "config.json").is_file()
    assert torch.isfinite(load_file(str(parts / "full" / "model.safetensors"))[TENSOR]).all()


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["math,code"], r"`names\[0\]` 'math,code' holds a comma"),
        ([" math"], r"`names\[0\]` ' math' has leading or trailing space"),
        (["math "], r"`names\[0\]` 'math ' has leading or trailing space"),
        ([""], r"`names\[0\]` '' is empty or blank"),
        (["   "], r"`names\[0\]` '   ' is empty or blank"),
        ([3], r"`names\[0\]` 3 is a int, not a string"),
    ],
)
def test_a_name_a_request_could_not_give_is_refused_before_anything_is_written(parts, tmp_path, names, message):
    """`experts: "a,b"` splits at the comma and strips each name: a folder whose names a request cannot give would
    refuse its own experts once served."""
    with pytest.raises(ValueError, match=rf"^{message}.*: an expert's name is what a request gives in `experts`"):
        build_vllm_model(tmp_path / "out", parts / "base", [parts / "full"], names=names)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("folder_name", ["math,code", " math", "math "])
def test_a_folder_name_a_request_could_not_give_asks_for_names(parts, tmp_path, folder_name):
    expert = shutil.copytree(parts / "full", tmp_path / folder_name)
    with pytest.raises(ValueError, match=r"^`experts\[0\]`'s folder name .* so a request could not name it: give"):
        build_vllm_model(tmp_path / "out", parts / "base", [expert])
    assert not (tmp_path / "out").exists()
    out = build_vllm_model(tmp_path / "out", parts / "base", [expert], names=["math"])  # the hint works
    assert (out / "config.json").is_file()


def test_the_command_refuses_a_bad_name_in_one_line(parts, tmp_path, capsys):
    argv = ["vllm-model", "--base", str(parts / "base"), "--expert", str(parts / "full"), "--names", "a,b"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mergecompose vllm-model: error: `names[0]` 'a,b' holds a comma") and "\n" not in err
    assert not (tmp_path / "out").exists()
