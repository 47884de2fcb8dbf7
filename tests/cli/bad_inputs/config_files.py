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


# ---- found by tests/cli/test_fuzz_configs.py (200 mutants per config) ----------------------------


def merge_models_not_a_list(env):
    path = env.tmp / "merge.yaml"
    path.write_text(f"merge_method: ties\nbase_model: {env.checkpoints / 'base'}\nmodels: .nan\ndtype: float32\n")
    return Cli(["merge", str(path), "--out", str(env.tmp / "out")], [path])


def lm_eval_config_without_systems(env):
    path = env.tmp / "lm_eval.yaml"
    path.write_text("name: x\ntask: {type: lm_eval, names: [mine]}\ndevice: cpu\n")
    return Cli(["compare", str(path), "--out", str(env.tmp / "out")], [path])


def compare_task_type_a_mapping(env):
    path = env.tmp / "config.yaml"
    path.write_text("name: x\ntask: {type: {a: 1}}\n")
    return Cli(["compare", str(path), "--out", str(env.tmp / "out")], [path])


CASES += [
    Case("compare-task-type-a-mapping", "traceback", compare_task_type_a_mapping, r"unknown task type \{'a': 1\}"),
    Case(
        "merge-models-not-a-list", "traceback", merge_models_not_a_list, r"`models` must be a list of mappings, got nan"
    ),
    Case(
        "lm-eval-config-without-systems",
        "misleading",
        lm_eval_config_without_systems,
        r"`base` and `experts`, or `native_run`",
    ),
]
