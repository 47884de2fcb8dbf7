"""A user's merge method, named by import path, in `merge()`, `mergecompose merge` and a `compare` config.

The method lives outside the package, in tests/extensions/user_merges.py: θ = θ_base + λ · w_j τ_j per
tensor, where j maximises ‖w_i τ_i‖_p. Every result is checked against numbers computed here by hand.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from pydantic import ValidationError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mergecompose.cli import main
from mergecompose.core.io import read_yaml_mapping
from mergecompose.experiments.compare import run_compare
from mergecompose.experiments.compare_config import CompareConfig, config_fingerprint, fingerprint
from mergecompose.experiments.merge_selection import merged_model
from mergecompose.merging import TaskVector, in_memory_checkpoints, merge, merge_checkpoints, validate_merge_params

EXTENSIONS = Path(__file__).parents[1] / "extensions"
FUNCTION = "user_merges:largest_task_vector"
CLASS = "user_merges:LargestTaskVector"


@pytest.fixture(autouse=True)
def user_code(monkeypatch):
    monkeypatch.syspath_prepend(str(EXTENSIONS))


def largest(base: dict, task_vectors: list[dict], lam: float, weights=None) -> dict:
    """The expected merge, written out again: per tensor, θ_base + λ · the w_i τ_i of largest L2 norm."""
    weights = weights or [1.0] * len(task_vectors)
    merged = {}
    for name, tensor in base.items():
        candidates = [weight * tv[name] for weight, tv in zip(weights, task_vectors) if name in tv]
        if not candidates:
            merged[name] = tensor
            continue
        norms = [candidate.norm().item() for candidate in candidates]
        merged[name] = tensor + lam * candidates[norms.index(max(norms))]
    return merged


# ---- in Python ------------------------------------------------------------------------------------------


def test_golden_values_for_the_function_and_the_class():
    base = {"w": torch.zeros(2, 2), "b": torch.ones(3)}
    # task vectors τ: ‖τ_w‖₂ = √2 and 2, ‖τ_w‖₁ = 2 and 2, ‖τ_b‖₂ = 3 and √3
    first = TaskVector({"w": torch.eye(2), "b": torch.tensor([3.0, 0.0, 0.0])})
    second = TaskVector({"w": torch.tensor([[0.0, -2.0], [0.0, 0.0]]), "b": torch.ones(3)})
    inputs = (base, first.tensors, second.tensors)
    kept = [{name: tensor.clone() for name, tensor in item.items()} for item in inputs]
    for method in (FUNCTION, CLASS):
        merged = merge(method, base, [first, second], lam=0.5, progress=False)
        assert torch.equal(merged["w"], torch.tensor([[0.0, -1.0], [0.0, 0.0]]))  # the second's, L2 2 > √2
        assert torch.equal(merged["b"], torch.tensor([2.5, 1.0, 1.0]))  # the first's, 3 > √3
    # p = 1: w ties at 2, so the first is kept; weights 3 and 1 make the first the larger in L2 too.
    assert torch.equal(
        merge(FUNCTION, base, [first, second], lam=0.5, norm_p=1.0, progress=False)["w"], 0.5 * torch.eye(2)
    )
    weighted = merge(FUNCTION, base, [first, second], weights=[3.0, 1.0], lam=0.5, progress=False)
    assert torch.equal(weighted["w"], 1.5 * torch.eye(2))
    for original, item in zip(kept, inputs):
        assert all(torch.equal(original[name], item[name]) for name in original)  # inputs untouched


def test_in_python_the_function_or_class_itself_is_named_by_its_import_path():
    """`merge(largest_task_vector, ...)`: the object gives the same merge as its import path; one that its path does
    not give back (a function defined inside another) is refused, naming what to pass instead."""
    import user_merges

    base = {"w": torch.zeros(2, 2)}
    first, second = TaskVector({"w": torch.eye(2)}), TaskVector({"w": torch.tensor([[0.0, -2.0], [0.0, 0.0]])})
    by_path = merge(FUNCTION, base, [first, second], lam=0.5, progress=False)
    for method in (user_merges.largest_task_vector, user_merges.LargestTaskVector, user_merges.LargestTaskVector()):
        assert torch.equal(merge(method, base, [first, second], lam=0.5, progress=False)["w"], by_path["w"])

    def inner(base, task_vectors, settings: user_merges.LargestSettings):
        return {}

    with pytest.raises(ValueError, match=r"cannot be named by an import path .*define it at the top of a module"):
        merge(inner, base, [first], progress=False)


def test_the_settings_record_the_import_path_as_the_method():
    settings = validate_merge_params(FUNCTION, {"lam": 0.5}, count=2)
    assert settings.method == FUNCTION and settings.weights == [1.0, 1.0] and settings.lam == 0.5


def test_tiny_models_merge_as_computed_by_hand(base_model, expert_models):
    base = base_model.state_dict()
    task_vectors = [TaskVector.from_models(base_model, expert).tensors for expert in expert_models]
    merged = merge(FUNCTION, base_model, expert_models, lam=0.7, progress=False)
    expected = largest(base, task_vectors, 0.7)
    assert max((merged[name] - expected[name]).abs().max().item() for name in expected) <= 1e-6
    assert any(not torch.equal(merged[name], base[name]) for name in base)


@pytest.mark.parametrize(
    ("method", "params", "expected"),
    [
        (
            "user_merges_missing:f",
            {},
            r"`method` 'user_merges_missing:f': module 'user_merges_missing' does not import",
        ),
        ("user_merges:nothing", {}, r"'user_merges' has no attribute 'nothing'"),
        ("user_merges:NoSettings", {}, r"has no attribute `settings`"),
        ("user_merges:untyped", {}, r"has no settings model: annotate its parameter `settings`"),
        ("user_merges:LargestSettings", {}, r"names a settings model; name the merge method"),
        (
            FUNCTION,
            {"density": 0.5},
            r"`density` does not apply to `user_merges:largest_task_vector`; valid .*lam, norm_p",
        ),
        (FUNCTION, {"lam": -1.0}, r"`lam`.*greater than 0.*-1\.0"),
        (FUNCTION, {"norm_p": 0.5}, r"`norm_p` must be >= 1.*0\.5"),
    ],
)
def test_bad_methods_and_parameters_raise_one_line(method, params, expected):
    with pytest.raises(ValueError, match=expected) as error:
        merge(method, {"w": torch.zeros(2)}, [{"w": torch.ones(2)}], progress=False, **params)
    assert len(str(error.value).splitlines()) == 1


# ---- `mergecompose merge` ------------------------------------------------------------------------------


def _config(tmp_path: Path, checkpoints: Path, experts: list, **params) -> str:
    path = tmp_path / "merge.yaml"
    path.write_text(yaml.safe_dump({"base": str(checkpoints / "base"), "experts": experts, **params}))
    return str(path)


def test_merge_command_runs_a_user_method_in_memory(checkpoints, lora_dirs, base_model, tmp_path, capsys):
    experts = [
        str(checkpoints / "expert_0"),
        {"path": str(checkpoints / "expert_1"), "weight": 0.5},
        str(lora_dirs["ab"]),
    ]
    config = _config(tmp_path, checkpoints, experts, method=FUNCTION, lam=0.5)
    out = tmp_path / "out"
    assert main(["merge", config, "--out", str(out), "--check"]) == 0 and not out.exists()
    assert main(["merge", config, "--out", str(out), "--quiet"]) == 0
    assert f"in-memory `{FUNCTION}` merge written to" in capsys.readouterr().out

    base = load_file(str(checkpoints / "base" / "model.safetensors"))
    task_vectors = [
        TaskVector.from_checkpoints(checkpoints / "base", checkpoints / f"expert_{i}").tensors for i in range(2)
    ]
    task_vectors.append(TaskVector.from_lora(base_model, lora_dirs["ab"]).tensors)
    expected = largest(base, task_vectors, 0.5, weights=[1.0, 0.5, 1.0])
    written = load_file(str(out / "model.safetensors"))
    assert max((written[name] - expected[name]).abs().max().item() for name in written) <= 1e-6
    assert (out / "config.json").is_file()
    resolved = read_yaml_mapping(out / "mergecompose_config.yaml", "resolved config")
    assert resolved["method"] == FUNCTION and resolved["lam"] == 0.5
    record = read_yaml_mapping(out / "merge_settings.yaml", "settings")
    assert record["settings"]["weights"] == [1.0, 0.5, 1.0] and len(record["source_sha256"]) == 64


@pytest.mark.parametrize(
    ("method", "params", "expected"),
    [
        ("user_merges_missing:f", {}, "module 'user_merges_missing' does not import"),
        ("user_merges:NoSettings", {}, "has no attribute `settings`"),
        (FUNCTION, {"density": 0.5}, "`density` does not apply to `user_merges:largest_task_vector`; valid parameters"),
    ],
)
def test_merge_command_refuses_a_bad_method_before_loading(
    checkpoints, tmp_path, capsys, monkeypatch, method, params, expected
):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was checked")

    monkeypatch.setattr(in_memory_checkpoints.AutoModelForCausalLM, "from_pretrained", no_loading)
    config = _config(tmp_path, checkpoints, [str(checkpoints / "expert_0")], method=method, **params)
    assert main(["merge", config, "--out", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mergecompose merge: error: ") and expected in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_mergekit_keeps_its_own_methods(checkpoints, tmp_path):
    ours = _config(tmp_path, checkpoints, [str(checkpoints / "expert_0")], method=FUNCTION)
    with pytest.raises(ValueError, match="is your own merge method, which runs in memory, not in mergekit"):
        merge_checkpoints(ours, tmp_path / "out")
    theirs = {
        "merge_method": FUNCTION,
        "base_model": str(checkpoints / "base"),
        "models": [{"model": str(checkpoints / "expert_0")}],
    }
    with pytest.raises(ValueError, match="is not a method mergekit runs"):
        merge_checkpoints(theirs, tmp_path / "out")


# ---- `compare` configs ----------------------------------------------------------------------------------

SMALL = {
    "name": "user_method",
    "task": {"train_lengths": [1, 4]},
    "positions": {"scheme": "coupled", "randomize": True, "max_position": 32},
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "max_position_embeddings": 32},
    "training": {
        "base": {"steps": 10, "batch_size": 16, "lr": 0.005},
        "experts": {"full": {"steps": 5, "batch_size": 16, "lr": 0.002}},
    },
    "evaluation": {
        "joint_size": 8,
        "split_size": 8,
        "validation_size": 8,
        "lengths": [4],
        "length_size": 8,
        "batch_size": 16,
        "greedy_check": 0,
    },
    "merges": {FUNCTION: {"lam": [0.5, 1.0], "norm_p": [2.0]}},
}


def test_grid_keys_are_checked_at_load_time():
    for merges, expected in [
        ({"ties": {"lam": [1.0], "density": [0.5], "norm_p": [1.0]}}, r"\['norm_p'\] are not grid keys of a built-in"),
        ({FUNCTION: {"norm_p": [0.5]}}, r"`norm_p` must be >= 1"),
        ({FUNCTION: {"gamma": [0.5]}}, r"`gamma` does not apply to `user_merges:largest_task_vector`"),
        ({FUNCTION: {"norm_p": 2.0}}, r"`norm_p` must list the values to try, got 2\.0"),
        ({"user_merges:nothing": {}}, r"has no attribute 'nothing'"),
    ]:
        with pytest.raises(ValidationError, match=expected):
            CompareConfig.model_validate({**SMALL, "merges": merges})


def test_the_fingerprint_follows_the_method_source(tmp_path, monkeypatch):
    module = tmp_path / "user_merges_edited.py"
    shutil.copy(EXTENSIONS / "user_merges.py", module)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = CompareConfig.model_validate({**SMALL, "merges": {"user_merges_edited:largest_task_vector": {}}})
    before = config_fingerprint(config)
    assert before != fingerprint(config)
    module.write_text(module.read_text() + "\n# edited\n")
    assert config_fingerprint(config) != before
    builtin = CompareConfig.model_validate({**SMALL, "merges": {"linear": {}}})
    assert config_fingerprint(builtin) == fingerprint(builtin)  # a config without user code keeps its hash


@pytest.mark.usefixtures("one_torch_thread")
def test_compare_selects_and_builds_a_user_merge(tmp_path):
    config = CompareConfig.model_validate(SMALL)
    results = run_compare(config, tmp_path / "run", progress=False, echo=None)
    assert results["config_hash"] == config_fingerprint(config)
    record = results["merges"][FUNCTION]
    assert [point["lam"] for point in record["validation"]] == [0.5, 1.0]
    assert record["chosen"] in [{"lam": 0.5, "norm_p": 2.0}, {"lam": 1.0, "norm_p": 2.0}]
    assert f"merge:{FUNCTION}" in results["systems"]

    # The merge compare scores, rebuilt from the run's checkpoints, is the one computed by hand.
    checkpoints = results["checkpoints"]
    base = AutoModelForCausalLM.from_pretrained(checkpoints["base"])
    experts = [AutoModelForCausalLM.from_pretrained(checkpoints["experts"][name]) for name in config.task.joint]
    built = merged_model(base, experts, FUNCTION, record["chosen"], seed=0).state_dict()
    task_vectors = [TaskVector.from_models(base, expert).tensors for expert in experts]
    expected = largest(base.state_dict(), task_vectors, record["chosen"]["lam"])
    assert max((built[name] - expected[name]).abs().max().item() for name in expected) <= 1e-6
