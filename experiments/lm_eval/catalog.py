"""Which lm-eval tasks exist, and which run model-written code: read from lm-eval's task index, before any model loads.

lm-eval's `TaskManager` indexes every task YAML it ships (a slow step) and those under
`include_path`. When every name asked for is found under `include_path` alone, the shipped
tasks are not indexed at all (so the tiny local tasks of the tests are found at once).
Managers are cached per (include paths, with or without the shipped tasks) for the process.

A task is *unsafe* when its YAML (with its `include:`s) sets `unsafe_code: true`, as lm-eval's
code benchmarks do (humaneval*, mbpp*); a group or a tag is unsafe when one of its tasks is.
lm-eval's Python-class tasks declare it in code; they are not seen here (lm-eval itself still
refuses them without `confirm_run_unsafe_code`, after loading the model).

lm-eval skips a task YAML it cannot read, and then "knows no task" of that name; `check_task_files`
reads every YAML under the include paths first (lm-eval's `!function` tag allowed, never imported) and
names the file and the field that is wrong.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Sequence
from pathlib import Path

import lm_eval
import yaml
from lm_eval.api.task import ALL_OUTPUT_TYPES
from lm_eval.tasks import TaskManager
from lm_eval.tasks._index import Kind


class _TaskYamlLoader(yaml.SafeLoader):
    """`yaml.safe_load` with lm-eval's `!function module.name` tag read as its text (nothing is imported)."""


_TaskYamlLoader.add_constructor("!function", lambda loader, node: f"!function {loader.construct_scalar(node)}")


def read_task_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """A task YAML as a mapping, with the files it `include:`s (read from its folder) under it, as lm-eval merges
    them; a file that does not parse, or is not a mapping, is a ValueError naming it."""
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_TaskYamlLoader)  # noqa: S506 - a SafeLoader
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as error:
        raise ValueError(f"task file {str(path)!r} cannot be read as YAML: {' '.join(str(error).split())}") from None
    if not isinstance(data, dict):
        raise ValueError(f"task file {str(path)!r} must be a mapping of task settings, got {type(data).__name__}")
    include = data.get("include")
    if isinstance(include, str) and path.resolve() not in seen:
        included = (path.parent / include).expanduser()
        if not included.is_file():
            raise ValueError(f"task file {str(path)!r}: `include` {include!r} is not a file beside it")
        data = {**read_task_yaml(included, (*seen, path.resolve())), **data}
    return data


def check_task_files(folders: Sequence[str | Path]) -> None:
    """Every task YAML under `folders` (as lm-eval finds them: `**/*.yaml`) parses and has what lm-eval needs: a
    task name, a known `output_type`, a dataset, `doc_to_choice` for multiple choice, a `metric_list` of metrics."""
    for folder in map(Path, folders):
        for path in sorted(folder.glob("**/*.yaml")):
            if path.is_file():
                _check_task_config(path, read_task_yaml(path))


def _check_task_config(path: Path, config: dict) -> None:
    where = f"task file {str(path)!r}"
    if "task" not in config or "class" in config or isinstance(config.get("task"), list):
        return  # a template for `include:`, a Python task, or a group: lm-eval checks those itself
    if not isinstance(config["task"], str) or not config["task"]:
        raise ValueError(f"{where}: `task` must be the task's name (a string), got {config['task']!r}")
    output_type = config.get("output_type", "generate_until")
    if output_type not in ALL_OUTPUT_TYPES:
        raise ValueError(f"{where}: `output_type` must be one of {ALL_OUTPUT_TYPES}, got {output_type!r}")
    if "dataset_path" not in config and "custom_dataset" not in config:
        raise ValueError(f"{where}: `dataset_path` is missing (the dataset lm-eval loads, e.g. `json`)")
    if output_type == "multiple_choice" and "doc_to_choice" not in config:
        raise ValueError(f"{where}: `output_type: multiple_choice` needs `doc_to_choice` (the choices of a document)")
    metrics = config.get("metric_list", [])
    if not isinstance(metrics, list) or any(not isinstance(item, dict) or "metric" not in item for item in metrics):
        raise ValueError(f"{where}: `metric_list` must be a list of mappings with a `metric` each, got {metrics!r}")


@functools.lru_cache(maxsize=8)
def _manager(include_paths: tuple[str, ...], include_defaults: bool) -> TaskManager:
    return TaskManager(include_path=list(include_paths) or None, include_defaults=include_defaults)


def task_manager(names: Sequence[str], include_paths: Sequence[str] = ()) -> TaskManager:
    """A `TaskManager` that knows `names`: the `include_paths` tasks alone if they hold them all, else with
    lm-eval's own."""
    include_paths = tuple(str(path) for path in include_paths)
    if include_paths:
        local = _manager(include_paths, False)
        if all(name in local.task_index for name in names):
            return local
    return _manager(include_paths, True)


def check_task_names(names: Sequence[str], include_paths: Sequence[str] = ()) -> TaskManager:
    """The manager of `names`; an unknown name is a ValueError that says how to list the valid ones."""
    manager = task_manager(names, include_paths)
    unknown = [name for name in names if name not in manager.task_index]
    if unknown:
        hints = {name: difflib.get_close_matches(name, manager.all_tasks, n=3) for name in unknown}
        close = "; ".join(f"{name!r}: did you mean {matches}?" for name, matches in hints.items() if matches)
        include = " --include_path DIR" if include_paths else ""
        raise ValueError(
            f"lm-eval {lm_eval.__version__} knows no task named {unknown}"
            + (f" ({close})" if close else "")
            + f"; list the valid names with `mergecompose lm-eval ls tasks{include}` (tasks, groups and tags), "
            "or put your own task YAMLs in a folder and name it as `task.include_path`"
        )
    return manager


def task_kind(manager: TaskManager, name: str) -> str:
    """ "task", "py_task", "group" or "tag": what `name` is in lm-eval's index."""
    return manager.task_index[name].kind.name.lower()


def unsafe_tasks(manager: TaskManager, names: Sequence[str]) -> list[str]:
    """The leaf tasks under `names` (tasks, groups, tags) whose config sets `unsafe_code: true`."""
    found: list[str] = []
    for name in names:
        for leaf, config in _leaves(manager, name, set()):
            if config.get("unsafe_code") and leaf not in found:
                found.append(leaf)
    return found


def leaf_configs(manager: TaskManager, names: Sequence[str]) -> dict[str, dict]:
    """Every leaf task under `names` (tasks, groups, tags) with its raw config (its `include:`s merged)."""
    return {leaf: config for name in names for leaf, config in _leaves(manager, name, set())}


def metric_names(config: dict) -> list[str] | None:
    """The metrics a task reports as lm-eval names them (`metric` and `metric,filter`), from its raw config; None
    when the config does not list them (lm-eval's defaults for its output type then apply)."""
    metrics = [
        item["metric"] for item in config.get("metric_list") or [] if isinstance(item, dict) and "metric" in item
    ]
    if not metrics:
        return None
    filters = [item.get("name") for item in config.get("filter_list") or [] if isinstance(item, dict)] or ["none"]
    return [*metrics, *(f"{metric},{name}" for metric in metrics for name in filters if name)]


def _leaves(manager: TaskManager, name: str, seen: set[str]) -> list[tuple[str, dict]]:
    """(leaf task name, its raw config) for every task under `name`, recursively."""
    entry = manager.task_index.get(name)
    if entry is None or name in seen:
        return []
    seen.add(name)
    if entry.kind is Kind.TAG:
        return [leaf for task in sorted(entry.tags) for leaf in _leaves(manager, task, seen)]
    if entry.kind is Kind.GROUP:
        leaves = []
        for member in (entry.cfg or {}).get("task") or []:
            if isinstance(member, str):
                leaves += _leaves(manager, member, seen)
            elif isinstance(member, dict) and isinstance(member.get("task"), str):
                inline = manager.task_index.get(member["task"])  # a registered task with overrides
                base = (inline.cfg or {}) if inline is not None else {}
                leaves.append((member["task"], {**base, **member}))
        return leaves
    return [(name, entry.cfg or {})]
