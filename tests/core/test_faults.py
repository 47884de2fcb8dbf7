"""Faults a run must survive: killed at any moment, started twice at once, a damaged cache.

The runs that are killed, and the run that holds a folder while another tries it, are processes
of their own running the real command line (`mergecompose.cli.main`, as the console script does).
Each is started ahead and held after its imports (most of its start-up) until told to go, so that
the imports of a test's processes overlap. A kill comes a seeded delay after the run enters a
phase (its temporary folder, named with its pid, appears; it holds its run folder), the delay up
to 1.2 times that phase's length in a timed unkilled run. The kills land wherever the timing puts
them, and every assertion holds wherever they land: no half-written output under a final name,
and a rerun that succeeds, removes what the killed runs left and reproduces the unkilled run's
results. Reruns run in this process (faster)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mergecompose.cli import main
from mergecompose.core.io import LeftoverWarning, remove_leftovers
from mergecompose.core.locks import RUN_LOCK_NAME
from mergecompose.core.tiny import random_llama, task_arithmetic_mergekit_config, tiny_llama_config
from mergecompose.experiments.compare import run_compare
from mergecompose.experiments.compare_config import load_config
from mergecompose.experiments.trained_models import entry_problem

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
# A compare scaled down to seconds of work: 3 letter skills with LoRA, two merge methods.
TINY = {
    "name": "tiny",
    "task": {"train_lengths": [1, 4]},
    "positions": {"scheme": "coupled", "randomize": True, "max_position": 24},
    "model": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "max_position_embeddings": 24},
    "training": {
        "base": {"steps": 30, "batch_size": 16, "lr": 0.01},
        "experts": {
            "full": {"steps": 8, "batch_size": 16, "lr": 0.01},
            "lora": {"rank": 2, "alpha": 4, "training": {"steps": 8, "batch_size": 16, "lr": 0.01}},
        },
    },
    "evaluation": {
        "joint_size": 16,
        "split_size": 8,
        "validation_size": 8,
        "lengths": [4],
        "length_size": 8,
        "batch_size": 32,
        "greedy_check": 2,
    },
    "merges": {"linear": {}, "task_arithmetic": {"lam": [0.5, 1.0]}},
}
COMPARE_FLAGS = ["--quiet", "--threads", "1"]
LEFTOVER = re.compile(r"\.(tmp|old)-")
_HELD = (
    "import sys, mergecompose.cli; print('ready', flush=True); sys.stdin.readline(); "
    "sys.exit(mergecompose.cli.main(sys.argv[1:]))"
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _start_held(argv: list, cwd: Path) -> subprocess.Popen:
    """A process of `mergecompose *argv`, imported and waiting for `_go`."""
    return subprocess.Popen(
        [sys.executable, "-c", _HELD, *map(str, argv)],
        cwd=cwd,
        env=ENV,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


@pytest.fixture
def held(tmp_path):
    """`held(argv)`: `_start_held` in `tmp_path`; every process still running at the end is killed."""
    processes: list[subprocess.Popen] = []

    def start(argv: list) -> subprocess.Popen:
        processes.append(_start_held(argv, tmp_path))
        return processes[-1]

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()


def _ready(*processes: subprocess.Popen) -> None:
    assert [process.stdout.readline().strip() for process in processes] == ["ready"] * len(processes)


def _go(process: subprocess.Popen) -> None:
    process.stdin.write("go\n")
    process.stdin.flush()


def _killed(process: subprocess.Popen, delay: float, after) -> None:
    """Go; once `after()` holds (or the process ended), wait `delay` seconds more.

    Then SIGKILL the process unless it ended, and reap it.
    """
    _go(process)
    deadline = time.monotonic() + 120
    while process.poll() is None and not after():
        assert time.monotonic() < deadline, "the run never reached the phase to kill it in"
        time.sleep(0.002)
    try:
        process.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        process.kill()
    process.wait()  # reaped: its pid no longer runs, so what it left is a killed run's


def _timed(process: subprocess.Popen, **conditions) -> dict[str, float]:
    """Go and run to the end: the seconds after go at which each condition first held, and `end`."""
    _go(process)
    started, seen = time.monotonic(), {}
    while process.poll() is None:
        for name, condition in conditions.items():
            if name not in seen and condition():
                seen[name] = time.monotonic() - started
        time.sleep(0.005)
    seen["end"] = time.monotonic() - started
    assert process.returncode == 0, process.stderr.read()
    return seen


def _kill_points(phase: float, count: int, seed: int) -> list[float]:
    """`count` seeded delays in [0, 1.2 × `phase`].

    Each falls into a phase that took `phase` seconds in a timed run, or just past it.
    """
    generator = random.Random(seed)
    return sorted(1.2 * phase * generator.random() for _ in range(count))


def _holds(folder: Path, process: subprocess.Popen):
    """Whether `process` holds the run folder `folder` (its pid is in the lock file)."""
    return lambda: (
        (folder / RUN_LOCK_NAME).is_file() and (folder / RUN_LOCK_NAME).read_text().strip() == str(process.pid)
    )


def _files(folder: Path) -> dict[str, bytes]:
    """Every file's bytes, but the model card's (README.md: it is titled with the output folder's name)."""
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != "README.md"
    }


def _leftovers(*folders: Path) -> list[Path]:
    return [path for folder in folders if folder.is_dir() for path in folder.iterdir() if LEFTOVER.search(path.name)]


def _rerun_naming_removals(argv: list, left: list[Path], capsys) -> None:
    """Run `mergecompose *argv` here; it must succeed and name each of the leftovers `left` as removed,
    in its one-line warnings on stderr."""
    capsys.readouterr()
    assert main([*map(str, argv)]) == 0
    command = argv[0]
    removals = [
        line
        for line in capsys.readouterr().err.splitlines()
        if line.startswith(f"mergecompose {command}: warning: removed ")
    ]
    for path in left:
        assert any(f"removed {path}, left by a killed run" in line for line in removals), (path, removals)


# ------------------------------------------------------------------------------------------- merge


@pytest.fixture(scope="module")
def larger_checkpoints(tmp_path_factory):
    """base/, expert_0/, expert_1/ of a model of 27 MB: large enough that writing a merge takes a while to kill."""
    root = tmp_path_factory.mktemp("larger_checkpoints")
    config = tiny_llama_config(vocab_size=8192, hidden_size=256, num_layers=4)
    for seed, name in enumerate(["base", "expert_0", "expert_1"]):
        random_llama(config, seed).save_pretrained(root / name)
    return root


def test_a_killed_merge_leaves_no_partial_output_and_the_rerun_removes_its_leftovers(
    larger_checkpoints, tmp_path, held, capsys
):
    config = tmp_path / "merge.yaml"
    config.write_text(yaml.safe_dump(task_arithmetic_mergekit_config(larger_checkpoints)))
    reference_dir, out = tmp_path / "reference", tmp_path / "merged"
    argv = ["merge", config, "--out", out, "--overwrite", "--quiet"]
    reference_run = held(["merge", config, "--out", reference_dir, "--quiet"])
    killed = [held(argv) for _ in range(3)]
    _ready(reference_run, *killed)
    # The writing phase: from the temporary folder's creation to its rename.
    seen = _timed(
        reference_run,
        writing=lambda: any(p.name.startswith(".reference.tmp-") for p in tmp_path.iterdir()),
        written=reference_dir.exists,
    )
    reference = _files(reference_dir)

    phase = seen.get("written", seen["end"]) - seen.get("writing", 0.0)
    for process, delay in zip(killed, _kill_points(phase, len(killed), seed=0)):
        # Into its writing phase: its temporary folder (named with its pid) exists.
        _killed(process, delay, after=lambda process=process: any(tmp_path.glob(f".merged.tmp-{process.pid}-*")))
        # Under its final name: nothing, or the whole merge (the kill came after the rename).
        assert not out.exists() or _files(out) == reference, f"killed {delay:.2f} s after the start"

    _rerun_naming_removals(argv, _leftovers(tmp_path), capsys)
    assert _files(out) == reference
    card = (out / "README.md").read_text()
    assert "# merged" in card and ".tmp-" not in card  # titled with the output's name, not the temporary folder's
    assert _leftovers(tmp_path) == []


def test_leftovers_of_running_writers_stay_and_older_ones_are_named(tmp_path):
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead = tmp_path / f".out.tmp-{finished.pid}-0123abcd"
    running = tmp_path / f".out.tmp-{os.getpid()}-0123abcd"
    older = tmp_path / ".out.tmp-89abcdef"  # a version that did not record its writer
    other = tmp_path / f".other.json.tmp-{finished.pid}-0123abcd.json"
    for path in (dead, running, older):
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"partial")
    other.write_text("{")
    with pytest.warns(LeftoverWarning) as caught:
        assert remove_leftovers(tmp_path, "out") == [dead]
    messages = [str(warning.message) for warning in caught]
    assert any(str(older) in message and "older version" in message for message in messages)
    assert any(f"removed {dead}" in message and str(finished.pid) in message for message in messages)
    assert running.exists() and older.exists() and other.exists() and not dead.exists()
    assert remove_leftovers(tmp_path, None) == [other]
    assert remove_leftovers(tmp_path / "missing") == []


# ----------------------------------------------------------------------------------------- compare


@pytest.fixture(scope="module")
def tiny_compare(tmp_path_factory):
    """An unkilled run of the tiny compare: (folder, config path, results, seconds of its work)."""
    root = tmp_path_factory.mktemp("faults_compare")
    config = root / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    out = root / "reference"
    process = _start_held(["compare", config, "--out", out, *COMPARE_FLAGS], root)
    try:
        _ready(process)
        # The work: from holding its folder to writing its results (then come the plots and the exit).
        seen = _timed(process, locked=_holds(out, process), written=(out / "results.json").is_file)
    finally:
        process.kill()
        process.wait()
    phase = seen.get("written", seen["end"]) - seen.get("locked", 0.0)
    return out, config, json.loads((out / "results.json").read_text()), phase


def _scores(results: dict) -> dict:
    """What a compare measured, without what depends on the run (timings, caching, paths)."""
    systems = {
        name: {key: value for key, value in record.items() if key != "seconds"}
        for name, record in results["systems"].items()
    }
    merges = {
        method: {key: value for key, value in record.items() if key != "cached"}
        for method, record in results["merges"].items()
    }
    return {"systems": systems, "merges": merges, "bars": results["bars"], "config_hash": results["config_hash"]}


def _check_entries(checkpoints: Path) -> None:
    for entry in checkpoints.iterdir():
        if entry.is_dir() and not entry.name.startswith("."):
            assert entry_problem(entry) is None, entry


def test_a_killed_compare_reruns_to_the_results_of_an_unkilled_one(tiny_compare, tmp_path, held, capsys):
    _, config, reference, phase = tiny_compare
    out = tmp_path / "killed"
    argv = ["compare", config, "--out", out, *COMPARE_FLAGS]
    killed = [held(argv) for _ in range(3)]
    _ready(*killed)
    for process, delay in zip(killed, _kill_points(phase, len(killed), seed=1)):
        _killed(process, delay, after=_holds(out, process))  # into its work: it holds its folder
        if (out / "results.json").exists():  # written last, atomically: complete if present
            assert _scores(json.loads((out / "results.json").read_text())) == _scores(reference)
        if (out / "checkpoints").is_dir():
            _check_entries(out / "checkpoints")  # every entry under its final name is whole

    _rerun_naming_removals(argv, _leftovers(out, out / "checkpoints"), capsys)
    assert _scores(json.loads((out / "results.json").read_text())) == _scores(reference)
    assert _leftovers(out, out / "checkpoints") == []


def test_a_truncated_cached_checkpoint_is_trained_again_with_a_warning(tiny_compare, tmp_path):
    reference_dir, config, reference, _ = tiny_compare
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    for entry in (reference_dir / "checkpoints").iterdir():  # a copy of the cache, so other tests keep theirs
        if entry.is_dir():
            target = out / "checkpoints" / entry.name
            target.mkdir()
            for path in entry.iterdir():
                (target / path.name).write_bytes(path.read_bytes())
    damaged = next((out / "checkpoints").glob("expert-ab-*")) / "model.safetensors"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])

    with pytest.warns(UserWarning, match=re.escape(str(damaged))):
        results = run_compare(load_config(config), out, progress=False, echo=None)
    assert _scores(results) == _scores(reference)
    assert [label for label, record in results["training"].items() if not record["cached"]] == ["expert-ab"]
    _check_entries(out / "checkpoints")


def test_concurrent_runs_one_folder_is_refused_shared_checkpoints_run_side_by_side(
    tiny_compare, tmp_path, held, capsys
):
    _, config, reference, _ = tiny_compare
    shared = tmp_path / "shared_checkpoints"
    shared.mkdir()
    first, second = tmp_path / "first", tmp_path / "second"
    for folder in (first, second):  # as `skills-sweep --checkpoints` does: the runs' checkpoints link to one folder
        folder.mkdir()
        (folder / "checkpoints").symlink_to(shared, target_is_directory=True)
    owner = held(["compare", config, "--out", first, *COMPARE_FLAGS])
    _ready(owner)
    _go(owner)
    deadline, holds = time.monotonic() + 60, _holds(first, owner)
    while not holds():
        assert time.monotonic() < deadline and owner.poll() is None, "the first run never took its folder"
        time.sleep(0.01)

    # A second run on the same folder (here, in this process) is refused at once.
    assert main(["compare", str(config), "--out", str(first), *COMPARE_FLAGS]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"mergecompose compare: error: `out_dir` (--out) {str(first)!r} is in use by another mergecompose run "
        f"(pid {owner.pid}); wait for it to finish or choose another folder"
    ]
    assert owner.poll() is None, "the refusal came after the first run had ended: it proves nothing"
    # One on another folder that shares the checkpoints runs beside it.
    neighbour = run_compare(load_config(config), second, progress=False, echo=None)
    _, error = owner.communicate(timeout=120)
    assert owner.returncode == 0, error

    runs = [json.loads((first / "results.json").read_text()), neighbour]
    for results in runs:
        assert _scores(results) == _scores(reference)
    # Each checkpoint was trained once, by one of the two runs; the other waited and reused it.
    for label in reference["training"]:
        assert sorted(results["training"][label]["cached"] for results in runs) == [False, True], label
    _check_entries(shared)
    assert _leftovers(shared) == []
