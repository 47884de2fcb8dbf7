"""Every config the project ships, mutated: each mutant is refused in one line that names the field, or accepted by
the command's pre-flight (`--check`), and either way before any model loads or training starts, writing nothing.

The mutations (`MUTATIONS`): drop a key; add a key one typo away from an existing one; give a value another
type; put NaN, inf, a negative, zero, an empty list, a huge number or a unicode string in a value; duplicate
an item of a list (an expert); point a path at a file, an empty folder or a folder of another kind. Each
config's placeholder paths (the mergekit YAMLs' `./checkpoints/...`, the MergeBench hub ids) are replaced by
tiny checkpoints first, so that the unmutated config is one the pre-flight accepts.

Outcomes (`OUTCOMES`): `refused` (exit 2, one line `mergecompose <command>: error: …` naming a key on the
mutated path or the value put there), `accepted` (exit 0 after the pre-flight), and the failures: `unnamed`
(one line that names neither), `traceback` (any exception out of `main`, or more than one line), `loaded` (a
model load or a training run began), `wrote` (the output folder, or anything beside the config, appeared).
Hypothesis runs derandomised, so CI sees the same mutants every time; `MERGECOMPOSE_FUZZ_EXAMPLES=N` sets the
examples per config (default 12), `MERGECOMPOSE_FUZZ_TALLY=FILE` writes the counts per outcome and the slowest
refusal's seconds. `MERGECOMPOSE_FUZZ_MODE=run` runs each command without `--check` (for counting what a version
without a pre-flight did): a mutant that reaches a model load or a training run is then `late` unless the
unmutated config gets there too, when it is `accepted`.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import re
import shutil
import socket
import tempfile
import time
from collections import Counter
from pathlib import Path

import mergekit.merge
import peft
import pytest
import transformers
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mergecompose.core.training
import mergecompose.experiments.trained_models
from mergecompose.cli import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
EXAMPLES = int(os.environ.get("MERGECOMPOSE_FUZZ_EXAMPLES", "12"))
CHECK = [] if os.environ.get("MERGECOMPOSE_FUZZ_MODE") == "run" else ["--check"]
OUTCOMES = ("refused", "accepted", "unnamed", "traceback", "loaded", "wrote", "late")
MUTATIONS = ("drop", "typo_key", "swap_type", "nan", "inf", "negative", "zero", "empty_list", "huge", "unicode")
MUTATIONS += ("duplicate", "path_to_file", "path_to_empty_folder", "path_to_other_kind")
_TALLY: Counter = Counter()
_SLOWEST: dict[str, float | str] = {}


def _command(name: str) -> list[str]:
    if name.startswith("merge_"):
        return ["merge"]
    if name.startswith("predict"):
        return ["predict-sweep"]
    if name.startswith("sweep_"):
        return ["overlap-sweep"]
    return ["compare"]


class _Loaded(BaseException):
    """Raised by a model load or a training run during a pre-flight (a BaseException: no handler takes it)."""


@pytest.fixture(scope="module")
def no_loading():
    """Every way a command loads a model or trains raises `_Loaded` while the module's tests run."""
    patches = pytest.MonkeyPatch()

    def refuse(*args, **kwargs):
        raise _Loaded

    patches.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))
    patches.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(refuse))
    patches.setattr(peft.PeftModel, "from_pretrained", classmethod(refuse))
    patches.setattr(mergecompose.core.training, "train_model", refuse)
    patches.setattr(mergecompose.experiments.trained_models, "train_model", refuse)
    patches.setattr(mergekit.merge, "run_merge", refuse)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    patches.setenv("HF_HUB_OFFLINE", "1")  # a hub id is refused at once, and the test needs no network
    patches.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    yield
    patches.undo()


def _placeholders(config: dict, checkpoints: Path) -> dict:
    """The config with its placeholder models replaced by the tiny checkpoints (base, expert_0, expert_1)."""
    tiny = {"base": checkpoints / "base", "math": checkpoints / "expert_0", "code": checkpoints / "expert_1"}
    text = json.dumps(config)
    for name, folder in tiny.items():
        text = text.replace(f"./checkpoints/{name}", str(folder))
    text = text.replace("google/gemma-2-2b", str(tiny["base"]))
    text = text.replace("MergeBench/gemma-2-2b_math", str(tiny["math"]))
    text = text.replace("MergeBench/gemma-2-2b_coding", str(tiny["code"]))
    config = json.loads(text)
    if config.get("device") == "cuda":  # the MergeBench config is for a GPU; this machine runs it on the CPU
        config["device"], config["dtype"] = "cpu", "float32"
    return config


def _places(data, path=()):
    """Every (path, value) in a nested mapping: keys and list items."""
    if isinstance(data, dict):
        for key, value in data.items():
            yield (*path, key), value
            yield from _places(value, (*path, key))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            yield (*path, index), value
            yield from _places(value, (*path, index))


def _parent(data, path):
    for key in path[:-1]:
        data = data[key]
    return data


def _typo(key: str) -> str:
    return key[:-1] + ("z" if key[-1] != "z" else "y") if key else "z"


def _mutate(config: dict, path: tuple, kind: str, folder: Path) -> tuple[dict, str | None]:
    """The mutant and the value it put in (for the check that the error names it); None: not applicable here."""
    mutant = copy.deepcopy(config)
    parent, key = _parent(mutant, path), path[-1]
    value = parent[key]
    if kind == "drop":
        del parent[key]
        return mutant, ""
    if kind == "typo_key":
        if not isinstance(key, str) or _typo(key) in parent:
            return config, None
        parent[_typo(key)] = parent.pop(key)
        return mutant, _typo(key)
    if kind == "duplicate":
        if not isinstance(value, list) or not value:
            return config, None
        value.append(copy.deepcopy(value[0]))
        return mutant, ""
    if kind.startswith("path_to_"):
        if not isinstance(value, str) or not (Path(value).exists() or (folder / value).exists()):
            return config, None
        target = folder / f"mutant_{kind}"
        if kind == "path_to_file":
            target.write_text("not what was expected\n")
        elif kind == "path_to_empty_folder":
            target.mkdir(exist_ok=True)
        else:  # a folder of another kind: a tokenizer-only folder where a model or a config was expected
            target.mkdir(exist_ok=True)
            (target / "tokenizer_config.json").write_text("{}")
        parent[key] = str(target)
        return mutant, str(target)
    new = {
        "swap_type": {"a": 1} if isinstance(value, (str, int, float, list)) else "a string",
        "nan": math.nan,
        "inf": math.inf,
        "negative": -(abs(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 1),
        "zero": 0,
        "empty_list": [],
        "huge": 10**30,
        "unicode": "ƒøø ☃ 模型",
    }[kind]
    parent[key] = new
    return mutant, new if isinstance(new, str) else ""


def _named(line: str, path: tuple, value: str | None) -> bool:
    names = [str(part) for part in path if isinstance(part, str)]
    return any(name in line for name in names) or bool(value and value in line)


def _run(argv: list[str]) -> tuple[str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    outcome, detail = _outcome(argv, stdout, stderr)
    seconds = time.perf_counter() - start
    if outcome == "refused" and seconds > float(_SLOWEST.get("seconds", 0.0)):
        _SLOWEST.update(seconds=round(seconds, 3), line=detail[:300])
    return outcome, detail


def _outcome(argv: list[str], stdout: io.StringIO, stderr: io.StringIO) -> tuple[str, str]:
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(argv)
    except _Loaded:
        return "loaded", ""
    except SystemExit as exit_:  # argparse's usage errors: not from a config
        return "traceback", f"SystemExit {exit_.code}: {stderr.getvalue()[-300:]}"
    except Exception as error:  # noqa: BLE001 - what escapes is the finding
        return "traceback", f"{type(error).__name__}: {error}"
    lines = [line for line in stderr.getvalue().splitlines() if line.strip()]
    if code == 0:
        return "accepted", stdout.getvalue().strip()[-200:]
    if code == 2 and len(lines) == 1 and lines[0].startswith(f"mergecompose {argv[0]}: error: "):
        return "refused", lines[0]
    return "traceback", f"exit {code}: {stderr.getvalue()[-400:]}"


def _baseline(name: str, config: dict) -> str:
    """The line the unmutated config is refused with (its temporary folder's name left out), or its outcome."""
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary) / "configs"
        shutil.copytree(CONFIGS, folder)
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(config, allow_unicode=True))
        outcome, detail = _run([*_command(name), str(folder / f"{name}.yaml"), "--out", f"{temporary}/out", *CHECK])
    return _without_folder(detail) if outcome == "refused" else outcome


def _without_folder(line: str) -> str:
    return re.sub(r"/tmp/[^/\s']+/", "TMP/", line)


def _write_tally() -> None:
    path = os.environ.get("MERGECOMPOSE_FUZZ_TALLY")
    if path:
        counts = Counter()
        for (_, outcome), n in _TALLY.items():
            counts[outcome] += n
        per_config = {f"{c} -> {o}": n for (c, o), n in sorted(_TALLY.items())}
        record = {"mode": "run" if not CHECK else "check", "outcomes": dict(counts), "slowest_refusal": _SLOWEST}
        Path(path).write_text(json.dumps({**record, "per_config": per_config}, indent=1))


@pytest.mark.parametrize("name", sorted(path.stem for path in CONFIGS.glob("*.yaml")))
def test_a_mutated_config_is_refused_in_one_line_or_accepted_before_any_work(name, checkpoints, no_loading):
    original = _placeholders(yaml.safe_load((CONFIGS / f"{name}.yaml").read_text()), checkpoints)
    places = [path for path, _ in _places(original)]
    baseline = _baseline(name, original)

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(path=st.sampled_from(places), kind=st.sampled_from(MUTATIONS))
    def mutant_is_handled(path, kind):
        with tempfile.TemporaryDirectory() as temporary:
            folder = Path(temporary) / "configs"
            shutil.copytree(CONFIGS, folder)  # the configs a config names sit beside it
            mutant, value = _mutate(original, path, kind, folder)
            if value is None:
                return
            config = folder / f"{name}.yaml"
            config.write_text(yaml.safe_dump(mutant, allow_unicode=True))
            before = sorted(p.name for p in folder.iterdir())
            out = Path(temporary) / "out"
            outcome, detail = _run([*_command(name), str(config), "--out", str(out), *CHECK])
            if outcome == "refused" and not _named(detail, path, value):
                # What the unmutated config is refused for (letters_lm_eval needs a finished letters run) may come
                # first; any other line must name the field.
                outcome = "refused" if _without_folder(detail) == baseline else "unnamed"
            if outcome == "loaded" and not CHECK:  # without --check, reaching the work is what a valid config does
                outcome = "accepted" if baseline == "loaded" else "late"
            changed = out.exists() or sorted(p.name for p in folder.iterdir()) != before
            if changed and (outcome == "refused" or (CHECK and outcome == "accepted")):
                outcome = "wrote"
            _TALLY[(name, outcome)] += 1
            _write_tally()
            assert outcome in ("refused", "accepted"), (
                f"{name}: {kind} at {'.'.join(map(str, path))}: {outcome}: {detail}"
            )

    mutant_is_handled()


def test_an_unmutated_config_passes_its_preflight(checkpoints, no_loading, tmp_path):
    """The fuzzing's baseline: a shipped config, placeholders replaced, is accepted by `--check` (so a mutant's
    refusal is the mutation's doing); and the harness can fail: a model load is caught as `loaded`."""
    config = tmp_path / "merge_ties.yaml"
    config.write_text(
        yaml.safe_dump(_placeholders(yaml.safe_load((CONFIGS / "merge_ties.yaml").read_text()), checkpoints))
    )
    assert _run(["compare", str(CONFIGS / "letters.yaml"), "--out", str(tmp_path / "out"), "--check"])[0] == "accepted"
    assert _run(["merge", str(config), "--out", str(tmp_path / "merged"), "--check"])[0] == "accepted"
    with pytest.raises(_Loaded):
        transformers.AutoModelForCausalLM.from_pretrained(str(checkpoints / "base"))
