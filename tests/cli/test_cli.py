"""The `mergecompose` command line as a whole: one error line and exit 2 for every command's expected
errors, `--debug` for the traceback, and the flags every command shares."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers.utils import logging as transformers_logging

from mergecompose.cli import build_parser, main
from mergecompose.core.cli_common import command_settings
from mergecompose.core.tiny import task_arithmetic_mergekit_config

ENTRY_POINT = Path(sys.executable).parent / "mergecompose"  # the installed console script, .venv/bin/mergecompose
COMMANDS = [
    "demo",
    "merge",
    "task-vector",
    "overlap",
    "overlap-sweep",
    "compare",
    "skills-sweep",
    "predict-sweep",
    "real-sweep",
    "fit-verdict",
    "vllm-model",
    "fetch-model",
    "convert-gguf",
    "generate",
    "decide",
    "joint-task",
    "decide-replay",
    "export-records",
    "score-rule",
    "fit-rule",
]
WRITING_COMMANDS = [
    "merge",
    "task-vector",
    "overlap",
    "overlap-sweep",
    "compare",
    "skills-sweep",
    "predict-sweep",
    "real-sweep",
    "fit-verdict",
    "vllm-model",
    "fetch-model",
    "convert-gguf",
    "decide",
    "joint-task",
    "decide-replay",
    "export-records",
    "score-rule",
    "fit-rule",
]


@pytest.fixture(scope="module")
def merge_config(checkpoints, tmp_path_factory):
    """A mergekit YAML over the shared saved checkpoints, in a folder of its own."""
    path = tmp_path_factory.mktemp("cli_merge_config") / "merge.yaml"
    path.write_text(yaml.safe_dump(task_arithmetic_mergekit_config(checkpoints)))
    return path


def one_error_line(capsys, command: str) -> str:
    """The single stderr line of an expected error, checked for its prefix and the absence of a traceback."""
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"mergecompose {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


# Commands that pass another tool's own arguments through, in that tool's spelling: no flags of ours.
PASS_THROUGH = ["lm-eval"]


def test_every_command_has_the_shared_flags():
    subparsers = next(action for action in build_parser()._actions if action.dest == "command")
    assert sorted(subparsers.choices) == sorted(COMMANDS + PASS_THROUGH)
    for name in PASS_THROUGH:
        assert not {flag for action in subparsers.choices[name]._actions for flag in action.option_strings}, name
    for name, parser in subparsers.choices.items():
        if name in PASS_THROUGH:
            continue
        flags = {flag for action in parser._actions for flag in action.option_strings}
        assert {"--quiet", "--threads"} <= flags, name
        assert "--no-progress" not in flags, name
        if name in WRITING_COMMANDS:
            assert {"--out", "--overwrite"} <= flags, name
    assert "--debug" in build_parser().format_help()


# Arguments that parse, for each command, before `--threads`.
VALID_ARGUMENTS = {
    "demo": [],
    "merge": ["merge.yaml", "--out", "out"],
    "task-vector": ["base", "finetuned", "--out", "out"],
    "overlap": ["--out", "out"],
    "overlap-sweep": ["sweep.yaml", "--out", "out"],
    "compare": ["config.yaml", "--out", "out"],
    "skills-sweep": ["config.yaml", "--out", "out"],
    "predict-sweep": ["predict.yaml", "--out", "out"],
    "real-sweep": ["real.yaml", "--out", "out"],
    "fit-verdict": ["--predict", "runs/predict", "--out", "out"],
    "vllm-model": ["--base", "base", "--expert", "expert", "--out", "out"],
    "fetch-model": ["smollm2-135m-instruct", "--out", "out"],
    "convert-gguf": ["x.gguf", "--out", "out"],
    "generate": ["a prompt", "--base", "base", "--expert", "expert"],
    "decide": ["--base", "base", "--expert", "a", "--expert", "b", "--task", "task.jsonl", "--out", "out"],
    "joint-task": ["units", "json", "--out", "task.jsonl"],
    "decide-replay": ["--records", "records.json", "--out", "out"],
    "export-records": ["--predict", "runs/predict", "--out", "out.json"],
    "score-rule": ["--records", "records.json", "--out", "rule.json"],
    "fit-rule": ["--records", "records.json", "--out", "out"],
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_threads_below_one_is_a_usage_error(command, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, *VALID_ARGUMENTS[command], "--threads", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"mergecompose {command}: error: argument --threads: must be an integer >= 1, got" in err


def test_missing_config_files(tmp_path, capsys):
    missing = str(tmp_path / "missing.yaml")
    out = str(tmp_path / "out")
    cases = {
        "merge": (["merge", missing, "--out", out], "does not exist"),
        "overlap-sweep": (["overlap-sweep", missing, "--out", out], "does not exist"),
        "compare": (["compare", missing, "--out", out], "does not exist"),
        "skills-sweep": (["skills-sweep", missing, "--out", out], "does not exist"),
        "overlap": (["overlap", "--config", missing], "`--config overlap config`"),
    }
    for command, (arguments, message) in cases.items():
        assert main(arguments) == 2, command
        assert message in one_error_line(capsys, command)
    assert not (tmp_path / "out").exists()


def test_invalid_values(tmp_path, capsys):
    assert main(["demo", "--max-new-tokens", "0"]) == 2
    assert "`max_new_tokens` must be >= 1, got 0" in one_error_line(capsys, "demo")
    config = tmp_path / "skills.yaml"
    config.write_text("name: x\n")
    assert main(["skills-sweep", str(config), "--out", str(tmp_path / "out"), "--expert-noise", "-1"]) == 2
    assert "`--expert-noise` must be >= 0, got -1.0" in one_error_line(capsys, "skills-sweep")


def test_pydantic_errors_are_joined_into_one_line(tmp_path, capsys):
    arguments = ["overlap", "--base", "b", "--expert", "e", "--data", str(tmp_path / "missing.jsonl"), "--lam", "-1"]
    assert main(arguments + ["--out", str(tmp_path / "out")]) == 2
    line = one_error_line(capsys, "overlap")
    assert "OverlapRunConfig: data: Value error, `data` must be an existing .jsonl file" in line
    assert "; lam: Input should be greater than 0 (got -1.0)" in line


def test_multi_line_messages_are_folded(tmp_path, capsys):
    """A config error that embeds pydantic's report, and a YAML syntax error, each become one line."""
    config = tmp_path / "bad.yaml"
    config.write_text("name: x\nunknown_field: 1\n")
    assert main(["compare", str(config), "--out", str(tmp_path / "out")]) == 2
    line = one_error_line(capsys, "compare")
    assert "invalid config" in line and "unknown_field" in line and "For further information" not in line
    config.write_text("name: [x\n")
    assert main(["compare", str(config), "--out", str(tmp_path / "out")]) == 2
    assert "while parsing" in one_error_line(capsys, "compare")


def test_merge_takes_out_as_a_flag_or_as_the_older_positional(merge_config, tmp_path, capsys):
    config = str(merge_config)
    by_flag, by_position = tmp_path / "out_1", tmp_path / "out_2"  # names of one length: config.json holds them
    assert main(["merge", config, "--out", str(by_flag)]) == 0
    printed_by_flag = capsys.readouterr().out
    assert main(["merge", config, str(by_position)]) == 0
    printed_by_position = capsys.readouterr().out
    assert printed_by_flag.replace(str(by_flag), str(by_position)) == printed_by_position
    written = [load_file(str(folder / "model.safetensors")) for folder in (by_flag, by_position)]
    assert written[0].keys() == written[1].keys()
    assert all(torch.equal(written[0][name], written[1][name]) for name in written[0])

    # Both forms refuse an existing folder alike, and replace it with --overwrite.
    for arguments in (["--out", str(by_flag)], [str(by_position)]):
        assert main(["merge", config, *arguments]) == 2
        assert "already exists" in one_error_line(capsys, "merge")
        assert main(["merge", config, *arguments, "--overwrite", "--quiet"]) == 0
    capsys.readouterr()

    assert main(["merge", config, str(tmp_path / "a"), "--out", str(tmp_path / "b")]) == 2
    assert "give the output folder once" in one_error_line(capsys, "merge")
    assert main(["merge", config]) == 2
    assert "the output folder is missing" in one_error_line(capsys, "merge")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_task_vector_reports_a_missing_base_of_an_adapter(lora_dirs, tmp_path, capsys):
    """transformers raises a plain OSError for a model folder that does not exist."""
    assert main(["task-vector", str(tmp_path / "no_base"), str(lora_dirs["ab"])]) == 2
    assert "no_base" in one_error_line(capsys, "task-vector")


def test_task_vector_refuses_an_existing_out_before_the_work(checkpoints, tmp_path, capsys):
    out = tmp_path / "figures"
    out.mkdir()
    # The fine-tuned folder is bad too: the existing --out is reported first.
    assert main(["task-vector", str(checkpoints / "base"), str(tmp_path / "nothing"), "--out", str(out)]) == 2
    assert "already exists" in one_error_line(capsys, "task-vector")
    assert list(out.iterdir()) == []
    arguments = ["task-vector", str(checkpoints / "base"), str(checkpoints / "expert_0"), "--out", str(out)]
    assert main(arguments + ["--overwrite", "--quiet"]) == 0
    assert "wrote" not in capsys.readouterr().out
    assert (out / "task_vectors.json").stat().st_size > 0


def test_debug_re_raises(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        main(["--debug", "compare", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "out")])


def test_quiet_drops_the_status_lines_not_the_results(capsys):
    assert main(["demo", "--max-new-tokens", "2"]) == 0
    loud = capsys.readouterr().out
    assert main(["demo", "--max-new-tokens", "2", "--quiet"]) == 0
    quiet = capsys.readouterr().out
    assert loud.startswith("Composed greedy decoding") and loud.endswith(quiet) and "base alone" in quiet


def test_command_settings_apply_threads_and_quiet_and_restore_them():
    previous = torch.get_num_threads()
    assert transformers_logging.is_progress_bar_enabled()
    with command_settings(threads=previous + 1, quiet=True):
        assert torch.get_num_threads() == previous + 1
        assert not transformers_logging.is_progress_bar_enabled()
    assert torch.get_num_threads() == previous and transformers_logging.is_progress_bar_enabled()
    with pytest.raises(ValueError), command_settings(threads=None, quiet=False):
        raise ValueError("restored on errors too")
    assert torch.get_num_threads() == previous


def test_installed_entry_point(tmp_path):
    """The console script itself: exit 2 with one line, and the traceback with `--debug`."""
    arguments = ["compare", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "out")]
    plain = subprocess.run([str(ENTRY_POINT), *arguments], capture_output=True, text=True, cwd=tmp_path)
    assert plain.returncode == 2
    expected = f"`config` {arguments[1]!r}: does not exist; expected a YAML file with a mapping of settings"
    assert plain.stderr.splitlines() == [f"mergecompose compare: error: {expected}"]
    debug = subprocess.run([str(ENTRY_POINT), "--debug", *arguments], capture_output=True, text=True, cwd=tmp_path)
    assert debug.returncode == 1
    assert "Traceback (most recent call last)" in debug.stderr and "InputFileError: `config`" in debug.stderr
