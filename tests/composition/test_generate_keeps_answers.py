"""`mergecompose generate --out` keeps what it finished: answers appended as each prompt finishes, a Ctrl-C that ends
in one line (exit 130) and a `--resume` that gives the uninterrupted run's file; outputs and prompts checked before a
weight loads (a missing folder created, a named pipe refused, `--max-new-tokens` beyond the context, JSON lines in a
.json file, blank prompts, a byte-order mark).

The model is tiny (hidden 32, 2 layers) with SmolLM2's tokenizer and vocabulary, so that the prompts are real text
and a prompt takes milliseconds."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mergecompose.cli import main
from mergecompose.core.cli_common import interrupts_once
from mergecompose.core.tiny import random_llama, random_lora_adapter, tiny_llama_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
PROMPTS = [f"Question {number}: what is {number} plus {number}?" for number in range(1, 7)]


@pytest.fixture(scope="module")
def tiny_text_model(smollm2_dir, tmp_path_factory) -> dict[str, str]:
    """A tiny random Llama over SmolLM2's vocabulary, with SmolLM2's tokenizer, and two LoRA experts of it."""
    folder = tmp_path_factory.mktemp("tiny_text")
    tokenizer = json.loads((smollm2_dir / "config.json").read_text())
    config = tiny_llama_config(vocab_size=tokenizer["vocab_size"])
    config.bos_token_id, config.eos_token_id = tokenizer.get("bos_token_id"), tokenizer.get("eos_token_id")
    config.pad_token_id = None
    base = random_llama(config, seed=0)
    base.save_pretrained(folder / "base")
    for name in TOKENIZER_FILES:
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, folder / "base" / name)
    experts = [str(random_lora_adapter(base, folder / name, seed=seed)) for seed, name in enumerate(("a", "b"), 1)]
    return {"base": str(folder / "base"), "a": experts[0], "b": experts[1]}


def _argv(model: dict[str, str], prompts: Path, out: Path, *extra: str) -> list[str]:
    return [
        "generate",
        "--base",
        model["base"],
        "--expert",
        model["a"],
        "--expert",
        model["b"],
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--quiet",
        *extra,
    ]


def _prompts(tmp_path: Path, prompts: list[str] = PROMPTS) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n")
    return path


@pytest.fixture(scope="module")
def uninterrupted(tiny_text_model, tmp_path_factory) -> Path:
    """The answers of an uninterrupted run, into a folder that does not exist yet (it is created)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    out = tmp / "not" / "yet" / "answers.jsonl"
    assert main(_argv(tiny_text_model, _prompts(tmp), out, "--max-new-tokens", "24")) == 0
    return out


def test_every_prompt_gets_a_whole_line_and_missing_folders_are_created(uninterrupted):
    records = [json.loads(line) for line in uninterrupted.read_text().splitlines()]
    assert [record["prompt"] for record in records] == PROMPTS
    assert all(record["text"] and record["settings"]["max_new_tokens"] == 24 for record in records)


def test_ctrl_c_ends_in_one_line_and_resume_gives_the_uninterrupted_file(tiny_text_model, uninterrupted, tmp_path):
    prompts, out = _prompts(tmp_path), tmp_path / "answers.jsonl"
    argv = _argv(tiny_text_model, prompts, out, "--max-new-tokens", "24")
    # Each prompt's answer is slowed so that the interrupt lands between prompts, after the first is kept.
    slow = tmp_path / "slow.py"
    slow.write_text(
        "import sys, time\n"
        "from mergecompose.composition import generate_command as g\n"
        "from mergecompose.cli import main\n"
        "append = g.AnswersFile.append\n"
        "def slow_append(self, record):\n"
        "    append(self, record)\n"
        "    time.sleep(2)\n"
        "g.AnswersFile.append = slow_append\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    process = subprocess.Popen(
        [sys.executable, str(slow), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while not (out.is_file() and out.read_text().count("\n") >= 1) and time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
    (line,) = [line for line in stderr.splitlines() if line.startswith("mergecompose generate:")]
    assert "interrupted (Ctrl-C)" in line and "--resume" in line
    kept = out.read_text()
    assert 1 <= kept.count("\n") < len(PROMPTS) and kept.endswith("\n")
    assert uninterrupted.read_text().startswith(kept)  # the finished answers, whole
    # Without --resume or --overwrite the file is refused, before anything loads; with --resume the run goes on.
    assert main(argv) == 2
    assert main([*argv, "--resume"]) == 0
    assert out.read_text() == uninterrupted.read_text()
    assert main([*argv, "--resume"]) == 0  # every prompt answered: nothing to do
    assert out.read_text() == uninterrupted.read_text()


def test_resume_drops_a_line_cut_by_a_kill(tiny_text_model, uninterrupted, tmp_path, capsys):
    text = uninterrupted.read_text()
    out = tmp_path / "answers.jsonl"
    cut = text[: text.index("\n", text.index("\n") + 1) + 1]  # two whole lines
    out.write_text(cut + text[len(cut) : len(cut) + 20])  # and half of the third
    argv = _argv(tiny_text_model, _prompts(tmp_path), out, "--max-new-tokens", "24", "--resume")
    assert main(argv) == 0
    assert "its last line was cut (a killed run)" in capsys.readouterr().err
    assert out.read_text() == text


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("--max-new-tokens", "8"), r"line 1 was generated with max_new_tokens=.24., this run has max_new_tokens=.8."),
        (("--weights", "1", "0.5"), r"line 1 was generated with weights="),
    ],
)
def test_resume_refuses_other_settings(tiny_text_model, uninterrupted, tmp_path, capsys, change, message):
    out = tmp_path / "answers.jsonl"
    shutil.copy(uninterrupted, out)
    argv = _argv(tiny_text_model, _prompts(tmp_path), out, "--max-new-tokens", "24", "--resume", *change)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert out.read_text() == uninterrupted.read_text()  # left as it was


def test_resume_refuses_other_prompts_and_a_file_generate_did_not_write(
    tiny_text_model, uninterrupted, tmp_path, capsys
):
    out = tmp_path / "answers.jsonl"
    shutil.copy(uninterrupted, out)
    other = _prompts(tmp_path, [PROMPTS[1], *PROMPTS[2:]])
    assert main(_argv(tiny_text_model, other, out, "--max-new-tokens", "24", "--resume")) == 2
    assert "--resume needs the same prompts in the same order" in capsys.readouterr().err
    out.write_text('{"something": "else"}\n')
    assert main(_argv(tiny_text_model, _prompts(tmp_path), out, "--max-new-tokens", "24", "--resume")) == 2
    assert "is not an answer `generate` wrote" in capsys.readouterr().err
    assert out.read_text() == '{"something": "else"}\n'
    with pytest.raises(SystemExit) as usage_error:
        main([*_argv(tiny_text_model, _prompts(tmp_path), out), "--resume", "--overwrite"])
    assert usage_error.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_overwrite_replaces_the_file_with_the_new_answers(tiny_text_model, uninterrupted, tmp_path):
    out = tmp_path / "answers.jsonl"
    out.write_text("old answers\n")
    two = _prompts(tmp_path, PROMPTS[:2])
    assert main(_argv(tiny_text_model, two, out, "--max-new-tokens", "24", "--overwrite")) == 0
    assert out.read_text().splitlines() == uninterrupted.read_text().splitlines()[:2]


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_named_pipe_as_out_is_refused_before_anything_loads(tiny_text_model, tmp_path, capsys, overwrite):
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    extra = ("--overwrite",) if overwrite else ()
    assert main(_argv(tiny_text_model, _prompts(tmp_path), pipe, *extra)) == 2
    err = capsys.readouterr().err
    assert "is not a regular file" in err and len(err.splitlines()) == 1, err
    assert pipe.is_fifo()


@pytest.mark.parametrize("max_new_tokens", ["256", "300", str(10**11)])
def test_max_new_tokens_beyond_the_context_is_refused_at_any_size(tiny_text_model, tmp_path, capsys, max_new_tokens):
    argv = _argv(tiny_text_model, _prompts(tmp_path), tmp_path / "out.jsonl", "--max-new-tokens", max_new_tokens)
    assert main([*argv, "--check"]) == 2
    err = capsys.readouterr().err
    assert f"`--max-new-tokens` {max_new_tokens} is beyond the context of `--base` (256 positions" in err, err


def test_a_prompt_with_max_new_tokens_beyond_the_context_is_named(tiny_text_model, tmp_path, capsys):
    argv = _argv(tiny_text_model, _prompts(tmp_path, ["short", "word " * 230]), tmp_path / "o.jsonl")
    assert main([*argv, "--max-new-tokens", "100", "--check"]) == 2
    assert "prompt 2 (" in capsys.readouterr().err


def test_weights_beyond_the_bound_are_refused_before_anything_loads(tiny_text_model, tmp_path, capsys):
    argv = _argv(tiny_text_model, _prompts(tmp_path), tmp_path / "o.jsonl", "--weights", "1e38", "1")
    assert main(argv) == 2
    assert "`weights[0]` must lie in [-100, 100] (the documented bound), got 1e+38" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "p.json",
            '{"prompt": "a"}\n{"prompt": "b"}\n',
            r"holds one JSON value per line \(JSON lines\).*name it \.jsonl",
        ),
        (
            "p.jsonl",
            '{"prompt": "a"}\n{"prompt": "   "}\n',
            r"line 2 must be an object with a non-blank string `prompt`",
        ),
        ("p.json", '["a", " \\t"]', r"item 1 must be an object with a non-blank string `prompt` or a non-blank string"),
        ("p.json", '{"prompt": "a"}', r"must hold a JSON list of prompts"),
    ],
)
def test_prompts_files_blank_prompts_and_json_lines(tiny_text_model, tmp_path, capsys, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    argv = _argv(tiny_text_model, path, tmp_path / "o.jsonl")
    assert main([*argv, "--check"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and re.search(message, err), err


def test_a_json_list_and_a_byte_order_mark(tiny_text_model, tmp_path):
    listed = tmp_path / "p.json"
    listed.write_text(json.dumps(["first", {"prompt": "second"}]))
    marked = tmp_path / "p.txt"
    marked.write_bytes("\ufefffirst\nsecond\n".encode())
    for prompts in (listed, marked):
        out = tmp_path / f"{prompts.name}.jsonl"
        assert main(_argv(tiny_text_model, prompts, out, "--max-new-tokens", "2")) == 0
        assert [json.loads(line)["prompt"] for line in out.read_text().splitlines()] == ["first", "second"]


def test_the_first_interrupt_raises_and_a_second_has_the_default_action():
    previous = signal.getsignal(signal.SIGINT)
    with interrupts_once():
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises in this frame as soon as the signal arrives
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL  # a second Ctrl-C kills at once
    assert signal.getsignal(signal.SIGINT) is previous
