"""`mergecompose generate` on the real SmolLM2 with two LoRA experts: the text of `ComposedLM.generate`, greedy,
streamed to the terminal and written as JSONL; prompts from a file; a base without a chat template."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from mergecompose.cli import main
from mergecompose.composition import ComposedLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "What is 7 times 6?"


def _experts(smollm2_adapters) -> list[str]:
    return [str(smollm2_adapters["math"]), str(smollm2_adapters["code"])]


def _expected_text(base, experts, weights, prompt, max_new_tokens, chat_template=True) -> str:
    tokenizer = AutoTokenizer.from_pretrained(base)
    if chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with ComposedLM.from_pretrained(base, experts, weights) as composed:
        output = composed.generate(ids, max_new_tokens=max_new_tokens)
    return tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)


def test_generate_gives_the_text_of_composed_generate_streamed_and_as_jsonl(
    smollm2_dir, smollm2_adapters, tmp_path, capsys
):
    experts, out = _experts(smollm2_adapters), tmp_path / "answers.jsonl"
    argv = ["generate", "--base", str(smollm2_dir), "--expert", experts[0], "--expert", experts[1]]
    argv += ["--weights", "1.0", "0.5", "--max-new-tokens", "16", PROMPT, "--out", str(out), "--quiet"]
    assert main(argv) == 0
    streamed = capsys.readouterr().out
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    expected = _expected_text(smollm2_dir, experts, [1.0, 0.5], PROMPT, 16)
    assert expected.strip() and record["text"] == expected
    assert expected.strip() in streamed  # the streamer printed it as it came
    assert record["prompt"] == PROMPT
    assert record["settings"]["experts"] == {"math": experts[0], "code": experts[1]}
    assert record["settings"]["weights"] == [1.0, 0.5] and record["settings"]["chat_template"] is True
    assert record["settings"]["max_new_tokens"] == 16 and record["settings"]["do_sample"] is False
    # --out is replaced only with --overwrite, and nothing is loaded before that is known.
    assert main(argv) == 2
    assert "pass --resume to go on from its answers, or --overwrite to replace it" in capsys.readouterr().err


def test_a_prompts_file_and_a_base_without_a_chat_template(smollm2_dir, smollm2_adapters, tmp_path, capsys):
    base = tmp_path / "plain_base"  # the same weights; the tokenizer without its chat template
    base.mkdir()
    for file in smollm2_dir.iterdir():
        if file.name == "model.safetensors":
            (base / file.name).symlink_to(file)
        elif file.name != "chat_template.jinja":
            shutil.copy(file, base / file.name)
    settings = json.loads((base / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(settings))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "The capital of France is"}) + "\n\n" + json.dumps({"prompt": "def add("}))
    out = tmp_path / "out.jsonl"
    experts = _experts(smollm2_adapters)
    argv = ["generate", "--base", str(base), "--expert", experts[0], "--expert", experts[1], "--prompts", str(prompts)]
    assert main([*argv, "--max-new-tokens", "6", "--out", str(out), "--check"]) == 0
    assert not out.exists()  # --check loads and writes nothing
    capsys.readouterr()
    assert main([*argv, "--max-new-tokens", "6", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("has no chat template") == 1  # said once, not per prompt
    assert "--- prompt 2 of 2" in captured.out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [record["prompt"] for record in records] == ["The capital of France is", "def add("]
    assert records[1]["text"] == _expected_text(base, experts, None, "def add(", 6, chat_template=False)
    assert all(record["settings"]["chat_template"] is False for record in records)
