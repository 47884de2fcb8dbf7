"""Bad input at the command line as a whole: configs, output folders, files that are not what they say."""

from __future__ import annotations

import os
from pathlib import Path

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
    return Cli(
        [
            "merge",
            str(_write(env, "m.yaml", yaml.safe_dump(_merge_config(env)))),
            "--out",
            str(env.checkpoints / "base"),
            "--overwrite",
        ]
    )


def merge_output_exists(env):
    (env.tmp / "out").mkdir()
    (env.tmp / "out" / "keep.txt").write_text("mine")
    return Cli(
        ["merge", str(_write(env, "m.yaml", yaml.safe_dump(_merge_config(env)))), "--out", str(env.tmp / "out")],
        inputs=[env.tmp / "out"],
    )


def merge_output_read_only(env):
    parent = env.tmp / "locked"
    parent.mkdir()
    os.chmod(parent, 0o500)
    return Cli(["merge", str(_write(env, "m.yaml", yaml.safe_dump(_merge_config(env)))), "--out", str(parent / "out")])


def merge_output_under_a_file(env):
    _write(env, "afile", "x")
    return Cli(
        [
            "merge",
            str(_write(env, "m.yaml", yaml.safe_dump(_merge_config(env)))),
            "--out",
            str(env.tmp / "afile" / "out"),
        ]
    )


def compare_config_missing(env):
    return Cli(["compare", str(env.tmp / "nope.yaml"), "--out", str(env.tmp / "out")])


def compare_config_non_utf8(env):
    return Cli(
        [
            "compare",
            str(_write(env, "latin1.yaml", "task:\n  type: letters\n# caf\xe9\n".encode("latin-1"))),
            "--out",
            str(env.tmp / "out"),
        ]
    )


CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def _config(name: str, mutate) -> dict:
    config = yaml.safe_load((CONFIGS / name).read_text())
    mutate(config)
    return config


def compare_with(mutate, source: str = "letters.yaml", command: str = "compare"):
    """`mergecompose COMMAND` on a copy of configs/SOURCE changed by `mutate` (refused before any training)."""

    def build(env):
        config = _config(source, mutate)
        if "compare" in config:  # a sweep names its compare config relative to its own folder, configs/
            config["compare"] = str(CONFIGS / config["compare"])
        for family in config.get("families", {}).values():  # so does each family of a predict-sweep
            family["compare"] = str(CONFIGS / family["compare"])
        path = _write(env, "config.yaml", yaml.safe_dump(config))
        return Cli([command, str(path), "--out", str(env.tmp / "out")])

    return build


def out_under_a_file(command_argv):
    def build(env):
        _write(env, "afile", "x")
        argv = [part.format(checkpoints=env.checkpoints, configs=CONFIGS) for part in command_argv]
        return Cli([*argv, "--out", str(env.tmp / "afile" / "out")])

    return build


def out_is_a_file(env):
    return Cli(
        ["compare", str(CONFIGS / "letters.yaml"), "--out", str(_write(env, "results", "x"))],
        inputs=[env.tmp / "results"],
    )


def _set(*keys, value):
    def mutate(config):
        node = config
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value

    return mutate


CASES = [
    Case("cli-malformed-yaml", "traceback", malformed_yaml, r"bad\.yaml.*line \d+"),
    Case("cli-merge-yaml-not-a-mapping", "traceback", merge_yaml_not_a_mapping, r"list\.yaml.*mapping"),
    Case("cli-merge-output-over-base", "data-loss", merge_output_over_base, r"lies inside the input"),
    Case("cli-merge-output-exists", "traceback", merge_output_exists, r"already exists.*--overwrite"),
    Case(
        "cli-merge-output-read-only",
        "traceback",
        merge_output_read_only,
        r"(permission|not writable).*locked",
        skip="root writes into read-only folders" if os.geteuid() == 0 else None,
    ),
    Case("cli-merge-output-under-a-file", "traceback", merge_output_under_a_file, r"afile"),
    Case("cli-compare-config-missing", "traceback", compare_config_missing, r"nope\.yaml.*(does not exist|no such)"),
    Case("cli-compare-config-non-utf8", "traceback", compare_config_non_utf8, r"latin1\.yaml.*(utf-8|UTF-8)"),
    Case(
        "cli-compare-out-under-a-file",
        "traceback",
        out_under_a_file(["compare", "{configs}/letters.yaml"]),
        r"afile.*is a file",
    ),
    Case(
        "cli-overlap-out-under-a-file",
        "traceback",
        out_under_a_file(["overlap", "--base", "{checkpoints}/base", "--expert", "{checkpoints}/expert_0"]),
        r"afile.*is a file",
    ),
    Case(
        "cli-task-vector-out-under-a-file",
        "traceback",
        out_under_a_file(["task-vector", "{checkpoints}/base", "{checkpoints}/expert_0"]),
        r"afile.*is a file",
    ),
    Case("cli-compare-out-is-a-file", "traceback", out_is_a_file, r"results.*is a file"),
    Case(
        "cli-compare-lora-target-unknown",
        "traceback",
        compare_with(_set("training", "experts", "lora", "target_modules", value=["nope"])),
        r"target_modules.*nope",
    ),
    # Config errors that were already one clear line, kept so they stay so.
    Case("cli-compare-unknown-key", "clear", compare_with(_set("bogus", value=1)), r"bogus.*not permitted"),
    Case(
        "cli-compare-steps-not-a-number",
        "clear",
        compare_with(_set("training", "base", "steps", value="many")),
        r"training\.base\.steps.*integer",
    ),
    Case(
        "cli-compare-joint-unknown-skill",
        "clear",
        compare_with(_set("task", "joint", value=["ab", "zz"])),
        r"joint.*'zz'",
    ),
    Case(
        "cli-compare-hidden-not-divisible",
        "clear",
        compare_with(_set("model", "hidden_size", value=63)),
        r"hidden_size.*63",
    ),
    Case(
        "cli-compare-warmup-above-one",
        "clear",
        compare_with(_set("training", "base", "warmup_fraction", value=2)),
        r"warmup_fraction.*less than 1",
    ),
    Case(
        "cli-compare-lengths-beyond-positions",
        "clear",
        compare_with(_set("evaluation", "lengths", value=[5000])),
        r"max_position.*5000",
    ),
    Case(
        "cli-compare-unknown-merge-method",
        "clear",
        compare_with(_set("merges", "foo", value={})),
        r"unknown merge methods.*foo",
    ),
    Case(
        "cli-skills-marker-clash",
        "clear",
        compare_with(lambda c: c["task"]["skills"][1].update(open="["), source="skills_k2.yaml"),
        r"marker.*distinct",
    ),
    Case(
        "cli-sweep-pair-unknown-skill",
        "clear",
        compare_with(lambda c: c["pairs"].append(["ab", "zz"]), source="sweep_letters.yaml", command="overlap-sweep"),
        r"'zz'",
    ),
    Case(
        "cli-sweep-density-above-one",
        "clear",
        compare_with(
            _set("merges", "ties", "density", value=[2.0]), source="sweep_letters.yaml", command="overlap-sweep"
        ),
        r"density.*2\.0",
    ),
    Case(
        "cli-predict-pair-unknown-skill",
        "clear",
        compare_with(
            lambda c: c["families"]["letters_weak"]["settings"].append({"name": "x", "pair": ["ab", "zz"]}),
            source="predict.yaml",
            command="predict-sweep",
        ),
        r"letters_weak.*'zz'.*letter_skills",
    ),
    Case(
        "cli-predict-k-beyond-skills",
        "clear",
        compare_with(
            lambda c: c["families"]["skills_double"]["settings"].append({"name": "x", "k": 9}),
            source="predict.yaml",
            command="predict-sweep",
        ),
        r"skills_double.*`k` = 9 but the compare config lists 4 skills",
    ),
    Case(
        "cli-predict-skills-setting-with-pair",
        "clear",
        compare_with(
            lambda c: c["families"]["skills_weak"]["settings"].append({"name": "x", "pair": ["a", "b"]}),
            source="predict.yaml",
            command="predict-sweep",
        ),
        r"skills_weak.*needs `k`",
    ),
    Case(
        "cli-predict-setting-name-repeated",
        "clear",
        compare_with(
            lambda c: c["families"]["skills_weak"]["settings"].append({"name": "lc_ab_cd", "k": 2}),
            source="predict.yaml",
            command="predict-sweep",
        ),
        r"unique.*lc_ab_cd",
    ),
    Case(
        "cli-predict-no-merges",
        "clear",
        compare_with(_set("merges", value={}), source="predict.yaml", command="predict-sweep"),
        r"`merges` must name at least one method",
    ),
    Case(
        "cli-predict-lora-without-lora-training",
        "clear",
        compare_with(
            lambda c: c["families"]["skills_double"].update(experts="lora"),
            source="predict.yaml",
            command="predict-sweep",
        ),
        r"skills_double.*`experts: lora` needs `training.experts.lora`",
    ),
]
