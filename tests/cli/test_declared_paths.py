"""Every command declares what it reads and writes, and `main` checks that before anything else; every expected
error, whatever its type, is one line and exit 2; `--check` runs the pre-flight alone.

The commands and their arguments are read from the parser, not listed here: a new command, or a new argument
that takes a path, fails `test_every_path_argument_is_declared` until it is declared.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel
from safetensors import SafetensorError

from mergecompose.cli import EXPECTED_ERRORS, build_parser, run_command
from mergecompose.core.cli_common import PathDeclaration, declared_inputs, paths_named_in
from mergecompose.core.locks import FolderInUseError

# What marks an argument as a path: its metavar, or a word of its help.
_PATH_METAVARS = {"DIR", "FILE", "PATH"}
_PATH_WORDS = re.compile(r"\b(folder|file|path|yaml|json|jsonl|checkpoint|adapter|hub id)s?\b", re.IGNORECASE)


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _takes_a_path(action: argparse.Action) -> bool:
    if action.nargs == 0 or action.dest in ("help", "threads", "check", "quiet", "overwrite", "debug"):
        return False
    return action.metavar in _PATH_METAVARS or bool(_PATH_WORDS.search(action.help or ""))


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_every_path_argument_is_declared(command):
    parser = _subcommands()[command]
    declaration = parser.get_default("declared_paths")
    assert isinstance(declaration, PathDeclaration), f"`{command}` declares no paths (declare_paths)"
    path_arguments = {action.dest for action in parser._actions if _takes_a_path(action)}
    undeclared = path_arguments - declaration.named()
    undeclared -= set(declaration.not_paths)
    assert not undeclared, f"`{command}` takes paths in {sorted(undeclared)} but does not declare them"
    unknown = {*declaration.named(), *declaration.not_paths} - {action.dest for action in parser._actions}
    assert not unknown, f"`{command}` declares {sorted(unknown)}, which it has no argument for"


def test_the_path_check_finds_a_path_argument():
    """The heuristic of the test above can fail: a parser with an undeclared `--weights FILE` is caught."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--weights", metavar="FILE")
    parser.add_argument("--steps", type=int, help="how many steps")
    assert {a.dest for a in parser._actions if _takes_a_path(a)} == {"weights"}


def test_a_config_names_its_inputs_relative_to_itself_or_the_working_folder(tmp_path, monkeypatch):
    (tmp_path / "configs").mkdir()
    (tmp_path / "models" / "expert").mkdir(parents=True)
    (tmp_path / "configs" / "tasks").mkdir()
    other = tmp_path / "configs" / "other.yaml"
    other.write_text(yaml.safe_dump({"data": "tasks"}))
    config = tmp_path / "configs" / "main.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "experts": {"a": "models/expert", "b": "org/hub-model"},  # cwd-relative, and a hub id
                "compare": "other.yaml",  # config-relative, naming a folder in turn
                "alphabet": "/",  # exists, but names the root: not an input
                "out": "models",  # an output key: not an input
            }
        )
    )
    monkeypatch.chdir(tmp_path)
    named = {str(Path(text).resolve()) for text in paths_named_in(config)}
    assert named == {str(tmp_path / "models" / "expert"), str(other), str(tmp_path / "configs" / "tasks")}


def _args(func, **values) -> argparse.Namespace:
    return argparse.Namespace(command="probe", debug=False, func=func, declared_paths=PathDeclaration(), **values)


class _Model(BaseModel):
    steps: int


def _validation_error():
    try:
        _Model.model_validate({"steps": "many"})
    except ValueError as error:
        return error


# One instance of each type of error a user's input can cause, and what its line must say.
EXPECTED = [
    (ValueError("`lam` must be finite, got nan"), r"`lam` must be finite"),
    (_validation_error(), r"steps"),
    (json.JSONDecodeError("Expecting value", "x", 0), r"Expecting value"),
    (FileExistsError("`--out` 'x' already exists"), r"already exists"),
    (PermissionError("'x' is not readable"), r"not readable"),
    (FolderInUseError("runs/x is in use by pid 7"), r"in use"),
    (yaml.YAMLError("bad indentation"), r"bad indentation"),
    (SafetensorError("incomplete metadata, file not fully covered"), r"incomplete metadata"),
    (ModuleNotFoundError("No module named 'lm_eval'", name="lm_eval"), r"lm_eval.*mergecompose\[lm-eval\]"),
    (ModuleNotFoundError("No module named 'gguf'", name="gguf"), r"gguf.*mergecompose\[real-model\]"),
]


@pytest.mark.parametrize("error, line", EXPECTED, ids=[type(e).__name__ + str(i) for i, (e, _) in enumerate(EXPECTED)])
def test_every_expected_error_is_one_line_and_exit_2(error, line, capsys):
    def fail(args):
        raise error

    assert run_command(_args(fail)) == 2
    err = capsys.readouterr().err
    lines = [text for text in err.splitlines() if text.strip()]
    assert len(lines) == 1 and lines[0].startswith("mergecompose probe: error: "), err
    assert re.search(line, lines[0]), lines[0]


@pytest.mark.parametrize(
    "error",
    [KeyError("a bug"), TypeError("a bug"), RuntimeError("a bug"), ModuleNotFoundError("x", name="not_an_extra")],
)
def test_a_bug_keeps_its_traceback(error):
    """Only expected errors become one line: an error of our own code (a bug) is raised, so it can be found."""

    def fail(args):
        raise error

    assert not isinstance(error, EXPECTED_ERRORS) or isinstance(error, ModuleNotFoundError)
    with pytest.raises(type(error)):
        run_command(_args(fail))


def test_the_paths_are_checked_before_the_preflight_and_the_command(tmp_path, capsys):
    calls = []
    (tmp_path / "expert").mkdir()
    args = _args(lambda a: calls.append("run"), preflight=lambda a: calls.append("preflight"))
    args.declared_paths = PathDeclaration(inputs=("experts",))
    args.experts, args.out = [str(tmp_path / "expert")], str(tmp_path / "expert" / "out")
    assert declared_inputs(args) == [str(tmp_path / "expert")]
    assert run_command(args) == 2
    assert calls == [] and not (tmp_path / "expert" / "out").exists()
    assert "lies inside the input" in capsys.readouterr().err


def test_check_runs_the_preflight_alone(capsys):
    calls = []
    args = _args(lambda a: calls.append("run"), preflight=lambda a: calls.append("preflight"), check=True)
    assert run_command(args) == 0
    assert calls == ["preflight"]
    assert "check passed" in capsys.readouterr().out
