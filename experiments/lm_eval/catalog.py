"""Which lm-eval tasks exist, and which run model-written code: read from lm-eval's task index, before any model loads.

lm-eval's `TaskManager` indexes every task YAML it ships (a slow step) and those under
`include_path`. When every name asked for is found under `include_path` alone, the shipped
tasks are not indexed at all (so the tiny local tasks of the tests are found at once).
Managers are cached per (include paths, with or without the shipped tasks) for the process.

A task is *unsafe* when its YAML (with its `include:`s) sets `unsafe_code: true`, as lm-eval's
code benchmarks do (humaneval*, mbpp*); a group or a tag is unsafe when one of its tasks is.
lm-eval's Python-class tasks declare it in code; they are not seen here (lm-eval itself still
refuses them without `confirm_run_unsafe_code`, after loading the model).
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Sequence

import lm_eval
from lm_eval.tasks import TaskManager
from lm_eval.tasks._index import Kind


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
