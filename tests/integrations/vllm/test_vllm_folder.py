"""`build_vllm_model` / `mergecompose vllm-model`: the folder vLLM loads.

Every bad input is refused before the folder is written. These run in the main venv (no vLLM needed);
the engine itself is tested in tests/integrations/vllm/engine/ under .venv-vllm.
"""

from __future__ import annotations

import json

import pytest
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file

from mergecompose.analysis.data import char_tokenizer
from mergecompose.cli import main
from mergecompose.core.tiny import random_llama, random_lora_adapter, tiny_llama_config
from mergecompose.integrations.vllm.folder import PLACEHOLDER_WEIGHTS, build_vllm_model
from mergecompose.integrations.vllm.plugin import ARCHITECTURE


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """base (with a tokenizer), a full expert, a LoRA adapter, and the bad inputs of the issue."""
    root = tmp_path_factory.mktemp("vllm_folder")
    config = tiny_llama_config()
    base = random_llama(config, seed=0)
    base.save_pretrained(root / "base")
    char_tokenizer("abcdefghijklmnopqrstuvwxyz").save_pretrained(root / "base")
    random_llama(config, seed=1).save_pretrained(root / "full")
    random_lora_adapter(base, root / "lora", seed=2)
    random_llama(tiny_llama_config(vocab_size=72), seed=3).save_pretrained(root / "other_vocab")
    random_llama(config, seed=4).save_pretrained(root / "other_tokenizer")
    char_tokenizer("ABCDEFGHIJKLMNOPQRSTUVWXYZ").save_pretrained(root / "other_tokenizer")
    random_lora_adapter(random_llama(tiny_llama_config(hidden_size=48), seed=5), root / "other_base_lora", seed=6)
    dora = get_peft_model(random_llama(config, seed=7), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    dora.save_pretrained(str(root / "dora"))
    head = get_peft_model(random_llama(config, seed=8), LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    head.save_pretrained(str(root / "lora_on_head"))
    (root / "empty").mkdir()
    return root


def test_the_folder_names_the_composite_and_holds_no_checkpoint(parts, tmp_path):
    out = build_vllm_model(tmp_path / "model", parts / "base", [parts / "full", parts / "lora"], weights=[1.0, 0.5])
    config = json.loads((out / "config.json").read_text())
    base_config = json.loads((parts / "base" / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE]
    assert {key: value for key, value in config.items() if key not in ("architectures", "composition")} == {
        key: value for key, value in base_config.items() if key != "architectures"
    }
    composition = config["composition"]
    assert composition["base"] == str((parts / "base").resolve())
    assert composition["base_architecture"] == "LlamaForCausalLM"
    assert composition["weights"] == [1.0, 0.5]
    assert [(e["name"], e["kind"]) for e in composition["experts"]] == [("full", "full"), ("lora", "lora")]
    assert composition["experts"][1]["lora_scaling"] == 1.0  # random_lora_adapter: alpha = r
    assert composition["experts"][1]["lora_targets"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert (out / "tokenizer.json").read_bytes() == (parts / "base" / "tokenizer.json").read_bytes()
    assert load_file(str(out / PLACEHOLDER_WEIGHTS))["composition.weights"].tolist() == [1.0, 0.5]
    assert not list(out.glob("model*.safetensors"))  # no copy of any component


def test_the_command_writes_the_same_folder(parts, tmp_path, capsys):
    arguments = [
        "vllm-model",
        "--base",
        str(parts / "base"),
        "--expert",
        str(parts / "full"),
        "--expert",
        str(parts / "lora"),
        "--weights",
        "1",
        "0.5",
        "--quiet",
    ]
    assert main([*arguments, "--out", str(tmp_path / "cli")]) == 0
    build_vllm_model(tmp_path / "api", parts / "base", [parts / "full", parts / "lora"], weights=[1.0, 0.5])
    assert (tmp_path / "cli" / "config.json").read_text() == (tmp_path / "api" / "config.json").read_text()
    assert main([*arguments, "--out", str(tmp_path / "cli")]) == 2  # exists
    assert "already exists" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("experts", "base", "error", "words"),
    [
        (["other_vocab"], "base", ValueError, ["experts[0]", "vocabulary", "vocab_size: 72", "base: 64"]),
        (["full", "other_tokenizer"], "base", ValueError, ["experts[1]", "tokenizer", "differs from the base's"]),
        (["other_base_lora"], "base", ValueError, ["experts[0]", "does not fit `base`", "another base"]),
        (["missing"], "base", FileNotFoundError, ["experts[0]", "missing", "no such folder"]),
        (["full"], "missing", FileNotFoundError, ["`base`", "missing", "no such folder"]),
        (["full"], "lora", ValueError, ["`base`", "peft adapter"]),
        (["full"], "full", ValueError, ["`base`", "no tokenizer files"]),
        (["empty"], "base", ValueError, ["experts[0]", "neither a model folder", "nor a peft adapter"]),
        (["dora"], "base", ValueError, ["experts[0]", "DoRA"]),
        (["lora_on_head"], "base", ValueError, ["experts[0]", "lm_head", "q_proj"]),
    ],
)
def test_bad_inputs_are_one_clear_error_before_anything_is_written(parts, tmp_path, experts, base, error, words):
    with pytest.raises(error) as raised:
        build_vllm_model(tmp_path / "model", parts / base, [parts / name for name in experts])
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))
    assert not (tmp_path / "model").exists()


def test_bad_arguments(parts, tmp_path):
    with pytest.raises(ValueError, match=r"`weights` must hold one weight per expert \(2\), got 1"):
        build_vllm_model(tmp_path / "model", parts / "base", [parts / "full", parts / "lora"], weights=[1.0])
    with pytest.raises(ValueError, match="at least one"):
        build_vllm_model(tmp_path / "model", parts / "base", [])
    with pytest.raises(ValueError, match="is, contains or lies inside the input"):
        build_vllm_model(parts / "full" / "model", parts / "base", [parts / "full"])
    with pytest.raises(ValueError, match="`names` must be unique"):
        build_vllm_model(tmp_path / "model", parts / "base", [parts / "full", parts / "lora"], names=["a", "a"])


def test_a_command_line_error_is_one_line(parts, tmp_path, capsys):
    assert (
        main(
            [
                "vllm-model",
                "--base",
                str(parts / "base"),
                "--expert",
                str(parts / "nowhere"),
                "--out",
                str(tmp_path / "model"),
            ]
        )
        == 2
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mergecompose vllm-model: error: `experts[0]`")
