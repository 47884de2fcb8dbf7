"""Bad input at the command line as a whole: configs, output folders, files that are not what they say."""

from __future__ import annotations

import os

import yaml

from bad_inputs import Case, Cli


def _merge_config(env, **overrides) -> dict:
    config = {
        "merge_method": "task_arithmetic",
        "base_model": str(env.checkpoints / "base"),
        "models": [{"model": str(env.checkpoints / f"expert_{i}"), "parameters": {"weight": 0.5}} for i in range(2)],
        "dtype": "float32",
    }
    config.update(overrides)
    return config


def _write(env, name: str, text: str | bytes):
    path = env.tmp / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def malformed_yaml(env):
    return Cli(["compare", str(_write(env, "bad.yaml", "task: [letters\n  seed: 1\n")), "--out", str(env.tmp / "out")])


def merge_yaml_not_a_mapping(env):
    return Cli(["merge", str(_write(env, "list.yaml", "- 1\n- 2\n")), "--out", str(env.tmp / "out")])


def merge_output_over_base(env):
    return Cli(["merge", str(_write(env, "m.yaml", yaml.safe_dump(_merge_config(env)))),
                "--out", str(env.checkpoints / "base"), "--overwrite"])


def merge_output_exists(env):
    (env.tmp / "out").mkdir()
    (env.tmp / "out" / "keep.txt").write_text("mine")
    return Cli(["merge", str(_write(env, "m.yaml", yaml.safe_dump(_merge_config(env)))), "--out", str(env.tmp / "out")],
               inputs=[env.tmp / "out"])


def merge_output_read_only(env):
    parent = env.tmp / "locked"
    parent.mkdir()
    os.chmod(parent, 0o500)
    return Cli(["merge", str(_write(env, "m.yaml", yaml.safe_dump(_merge_config(env)))), "--out", str(parent / "out")])


def merge_output_under_a_file(env):
    _write(env, "afile", "x")
    return Cli(["merge", str(_write(env, "m.yaml", yaml.safe_dump(_merge_config(env)))), "--out", str(env.tmp / "afile" / "out")])


def compare_config_missing(env):
    return Cli(["compare", str(env.tmp / "nope.yaml"), "--out", str(env.tmp / "out")])


def compare_config_non_utf8(env):
    return Cli(["compare", str(_write(env, "latin1.yaml", "task:\n  type: letters\n# caf\xe9\n".encode("latin-1"))),
                "--out", str(env.tmp / "out")])


CASES = [
    Case("cli-malformed-yaml", "traceback", malformed_yaml, r"bad\.yaml.*line \d+"),
    Case("cli-merge-yaml-not-a-mapping", "traceback", merge_yaml_not_a_mapping, r"list\.yaml.*mapping"),
    Case("cli-merge-output-over-base", "data-loss", merge_output_over_base, r"lies inside the input"),
    Case("cli-merge-output-exists", "traceback", merge_output_exists, r"already exists.*--overwrite"),
    Case("cli-merge-output-read-only", "traceback", merge_output_read_only, r"(permission|not writable).*locked",
         skip="root writes into read-only folders" if os.geteuid() == 0 else None),
    Case("cli-merge-output-under-a-file", "traceback", merge_output_under_a_file, r"afile"),
    Case("cli-compare-config-missing", "traceback", compare_config_missing, r"nope\.yaml.*(does not exist|no such)"),
    Case("cli-compare-config-non-utf8", "traceback", compare_config_non_utf8, r"latin1\.yaml.*(utf-8|UTF-8)"),
]
