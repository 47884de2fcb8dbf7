"""A folder given where a config file is expected: every command that reads a config says it is a folder (it
said "does not exist"), before anything is read or written."""

from __future__ import annotations

from bad_inputs import Case, Cli

FOLDER = r"is a folder"


def _folder(env):
    folder = env.tmp / "configs"
    folder.mkdir()
    (folder / "letters.yaml").write_text("name: letters\n")
    return folder


def _command(argv_of):
    def build(env):
        folder = _folder(env)
        return Cli([*argv_of(str(folder)), "--out", str(env.tmp / "out")], [folder])

    return build


CASES = [
    Case("compare-config-is-a-folder", "misleading", _command(lambda f: ["compare", f]), FOLDER),
    Case("merge-config-is-a-folder", "misleading", _command(lambda f: ["merge", f]), FOLDER),
    Case("overlap-config-is-a-folder", "misleading", _command(lambda f: ["overlap", "--config", f]), FOLDER),
    Case("predict-sweep-config-is-a-folder", "misleading", _command(lambda f: ["predict-sweep", f]), FOLDER),
    Case("overlap-sweep-config-is-a-folder", "misleading", _command(lambda f: ["overlap-sweep", f]), FOLDER),
    Case("skills-sweep-config-is-a-folder", "misleading", _command(lambda f: ["skills-sweep", f]), FOLDER),
]
