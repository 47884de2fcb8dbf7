"""One row per bad or hostile input, for the CLI and the API (rows: `tests/cli/bad_inputs/`).

Every row must end in a clear error: on the command line exit 2 and one line
`mergecompose <command>: error: …` that names the problem, no traceback; in the API an error of the
expected type whose first line names it (or, for a warning row, a warning that says what was done).
No input file may change. `MERGECOMPOSE_BAD_INPUT_TALLY=FILE` also writes every row's outcome to
FILE (the counts per class in the reliability issue's note come from it).
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
from collections import Counter

import bad_inputs
import pytest
from bad_inputs import Env, run_case

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CASES = [
    case
    for module in sorted(m.name for m in pkgutil.iter_modules(bad_inputs.__path__))
    for case in importlib.import_module(f"bad_inputs.{module}").CASES
]
_TALLY: dict[str, dict] = {}


def test_case_ids_are_unique():
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids)), [i for i, n in Counter(ids).items() if n > 1]


def _write_tally() -> None:
    """Rewrite the tally file (after every row, so that an interrupted run still counts what it ran)."""
    path = os.environ.get("MERGECOMPOSE_BAD_INPUT_TALLY")
    if path:
        counts = Counter((row["issue_class"], row["outcome"]) for row in _TALLY.values())
        summary = {f"{cls} -> {outcome}": n for (cls, outcome), n in sorted(counts.items())}
        with open(path, "w") as handle:
            json.dump({"summary": summary, "cases": _TALLY}, handle, indent=1)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_gets_one_clear_error(case, checkpoints, lora_dirs, base_model, tiny_config, tmp_path):
    if case.skip:
        pytest.skip(case.skip)
    env = Env(
        tmp=tmp_path,
        checkpoints=checkpoints,
        lora_dirs=lora_dirs,
        base_model=base_model,
        tiny_config=tiny_config,
        shared=[checkpoints, *lora_dirs.values()],
    )
    result = run_case(case, env)
    _TALLY[case.id] = {
        "issue_class": case.issue_class,
        "outcome": result.outcome,
        "first_line": result.first_line[:300],
    }
    _write_tally()
    assert result.outcome == "clear", f"{result.outcome}: {result.first_line!r} {result.detail}"
