"""Bad and hostile inputs, one row each, for `tests/cli/test_bad_inputs.py`.

A row (`Case`) builds its input in a fresh folder, runs one CLI command or one API call, and says
what the first line of the error must name. The harness (`run_case`) then sorts the outcome into
the classes of the reliability issue:

* ``clear``: CLI exit 2 with one line ``mergecompose <command>: error: …`` that matches, or an API
  error of the expected type whose message matches (or, for a warning row, a matching warning);
* ``misleading``: an error of the expected kind whose first line does not match;
* ``traceback``: any other exception (the library's internals leaking out);
* ``silent``: no error at all (exit 0, or the call returned);
* ``data-loss``: an input file changed, was added or was deleted (checked first);
* ``late``: only with `MERGECOMPOSE_BAD_INPUT_ROW_SECONDS=N` (for counting what older code did):
  still working after N seconds, so the input was not refused before the work started.

Rows live in the modules of this package, one per area; each module exports `CASES`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import signal
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

OUTCOMES = ("clear", "misleading", "traceback", "silent", "data-loss", "late")
# The class each row belonged to when the issue was filed (what a user saw then; "clear" rows guard what held up).
ISSUE_CLASSES = ("clear", "traceback", "silent", "misleading", "data-loss")


@dataclass
class Cli:
    """`mergecompose *argv`; `inputs` are hashed before and after (the shared fixtures always are)."""

    argv: Sequence[str]
    inputs: Sequence[Path] = ()


@dataclass
class Api:
    """`call()` must raise `error` (or, with `warns`, emit that warning and return)."""

    call: Callable[[], object]
    inputs: Sequence[Path] = ()
    error: type[BaseException] | tuple[type[BaseException], ...] = (ValueError, TypeError, OSError)
    warns: type[Warning] | None = None


@dataclass(frozen=True)
class Case:
    """One bad input. `build(env)` returns a `Cli` or an `Api`; `expect` is a regex (case-insensitive)
    the error's first line must contain; `issue_class` is the class it fell in when reported."""

    id: str
    issue_class: str
    build: Callable[[Env], Cli | Api]
    expect: str
    skip: str | None = None  # a reason this machine cannot try the row (e.g. root ignores read-only folders)

    def __post_init__(self):
        assert self.issue_class in ISSUE_CLASSES, self.issue_class


@dataclass
class Env:
    """What a row may use: a fresh folder, the shared tiny checkpoints and adapters, the tiny model."""

    tmp: Path
    checkpoints: Path  # base/, expert_0/, expert_1/ (safetensors, config.json)
    lora_dirs: dict  # name -> peft adapter folder for base/
    base_model: object
    tiny_config: object
    shared: list[Path] = field(default_factory=list)


@dataclass
class Outcome:
    outcome: str
    first_line: str
    detail: str = ""


def digest(paths: Sequence[Path]) -> dict[str, str]:
    """sha256 of every file under each path (a missing path is recorded as missing)."""
    digests = {}
    for root in paths:
        root = Path(root)
        if not root.exists():
            digests[str(root)] = "missing"
            continue
        for path in sorted([root] if root.is_file() else (p for p in root.rglob("*") if p.is_file())):
            digests[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


def _first_line(text: str) -> str:
    return next((line for line in text.splitlines() if line.strip()), "")


def run_case(case: Case, env: Env) -> Outcome:
    """Build and run `case`, and sort what happened into one of `OUTCOMES`."""
    spec = case.build(env)
    inputs = [*env.shared, *spec.inputs]
    before = digest(inputs)
    with _time_limit(int(os.environ.get("MERGECOMPOSE_BAD_INPUT_ROW_SECONDS", "0"))) as limit:
        if isinstance(spec, Cli):
            outcome = _run_cli(spec, case.expect)
        else:
            outcome = _run_api(spec, case.expect)
    if limit.expired:
        outcome = Outcome("late", "", f"still working after {limit.seconds} s: not refused before the work")
    after = digest(inputs)
    if after != before:
        changed = sorted(set(before.items()) ^ set(after.items()))
        return Outcome("data-loss", outcome.first_line, f"inputs changed: {changed[:4]}")
    return outcome


class _OutOfTime(BaseException):
    """Raised by the alarm of `_time_limit`; a BaseException, so that no `except Exception` takes it."""


@dataclass
class _Limit:
    seconds: int
    expired: bool = False


@contextlib.contextmanager
def _time_limit(seconds: int):
    """Stop the block after `seconds` (0: no limit), recording that it ran out of time."""
    limit = _Limit(seconds)
    if seconds <= 0:
        yield limit
        return

    def expire(signum, frame):
        raise _OutOfTime

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield limit
    except _OutOfTime:
        limit.expired = True
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _run_cli(spec: Cli, expect: str) -> Outcome:
    from mergecompose.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    command = next((a for a in spec.argv if not a.startswith("-")), "")
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            code = main(list(spec.argv))
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    except Exception as error:  # noqa: BLE001 - sorting what escapes is the point
        return Outcome("traceback", f"{type(error).__name__}: {error}".splitlines()[0])
    err = stderr.getvalue()
    first = _first_line(err)
    if code == 0:
        return Outcome("silent", first, "exit 0")
    prefix = f"mergecompose {command}: error: "
    lines = [line for line in err.splitlines() if line.strip()]
    if code == 2 and len(lines) == 1 and first.startswith(prefix) and "Traceback" not in err:
        if re.search(expect, first[len(prefix) :], re.IGNORECASE):
            return Outcome("clear", first)
        return Outcome("misleading", first, f"does not match {expect!r}")
    if "Traceback" in err:
        return Outcome("traceback", first, err[-400:])
    return Outcome("misleading", first, f"exit {code}, {len(lines)} stderr lines: {err[-300:]}")


def _run_api(spec: Api, expect: str) -> Outcome:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            spec.call()
        except spec.error as error:
            first = _first_line(str(error)) or type(error).__name__
            if spec.warns is None and re.search(
                expect, str(error).splitlines()[0] if str(error) else "", re.IGNORECASE
            ):
                return Outcome("clear", first)
            return Outcome("misleading", f"{type(error).__name__}: {first}", f"does not match {expect!r}")
        except Exception as error:  # noqa: BLE001
            return Outcome("traceback", f"{type(error).__name__}: {_first_line(str(error))}")
    if spec.warns is not None:
        for warning in caught:
            if issubclass(warning.category, spec.warns) and re.search(
                expect, _first_line(str(warning.message)), re.IGNORECASE
            ):
                return Outcome("clear", _first_line(str(warning.message)))
        return Outcome(
            "silent", "", f"no {spec.warns.__name__} matching {expect!r}: {[str(w.message)[:80] for w in caught]}"
        )
    return Outcome("silent", "", "returned without an error")
