"""Runs that would lose data: a results folder another run is writing, the leftovers of a killed run.

The runs that hold a folder are other processes (a lock held in this one would be this run's own);
`tests/core/test_faults.py` kills and races real runs.
"""

from __future__ import annotations

import subprocess
import sys
import weakref
from pathlib import Path

import yaml

from bad_inputs import Api, Case, Cli
from mergecompose.core.io import LeftoverWarning
from mergecompose.core.locks import RUN_LOCK_NAME
from mergecompose.core.tiny import task_arithmetic_mergekit_config
from mergecompose.experiments.compare import run_compare
from mergecompose.experiments.compare_config import CompareConfig
from mergecompose.merging import merge_checkpoints

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
# Another run holding a results folder, as `mergecompose.core.locks.run_folder_lock` does: the flock, then its pid.
_HOLD = (
    "import fcntl, os, sys; descriptor = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
    "fcntl.flock(descriptor, fcntl.LOCK_EX); os.write(descriptor, str(os.getpid()).encode()); "
    "print('held', flush=True); sys.stdin.read()"
)


def _held_folder(env) -> tuple[Path, subprocess.Popen]:
    """A results folder held by another process, with one result in it (an input: it must not change)."""
    out = env.tmp / "run"
    out.mkdir()
    (out / "results.json").write_text('{"config_hash": "theirs"}')
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(out / RUN_LOCK_NAME)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    return out, holder


def _while_held(spec, holder: subprocess.Popen):
    """`spec`, with `holder` released (its stdin closed: it exits) once the row is done with `spec`."""

    def release():
        holder.stdin.close()
        holder.stdout.close()
        holder.wait()

    weakref.finalize(spec, release)
    return spec


def _tiny_compare_config() -> dict:
    return {"training": {"base": {"steps": 1}, "experts": {"full": {"steps": 1}}}}


def compare_folder_in_use(env):
    out, holder = _held_folder(env)
    config = env.tmp / "compare.yaml"
    config.write_text(yaml.safe_dump(_tiny_compare_config()))
    return _while_held(Cli(["compare", str(config), "--out", str(out), "--overwrite"], inputs=[out]), holder)


def compare_folder_in_use_api(env):
    out, holder = _held_folder(env)
    config = CompareConfig.model_validate(_tiny_compare_config())
    return _while_held(
        Api(lambda: run_compare(config, out, overwrite=True, progress=False, echo=None), inputs=[out]), holder
    )


def skills_sweep_folder_in_use(env):
    out, holder = _held_folder(env)
    argv = ["skills-sweep", str(CONFIGS / "skills_k2.yaml"), str(CONFIGS / "skills_k3.yaml"), "--out", str(out)]
    return _while_held(Cli(argv, inputs=[out]), holder)


def overlap_sweep_folder_in_use(env):
    out, holder = _held_folder(env)
    return _while_held(
        Cli(["overlap-sweep", str(CONFIGS / "sweep_letters.yaml"), "--out", str(out)], inputs=[out]), holder
    )


def merge_over_a_killed_runs_leftover(env):
    finished = subprocess.Popen(["true"])
    finished.wait()  # a pid that no longer runs
    leftover = env.tmp / f".merged.tmp-{finished.pid}-0123abcd"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"\0" * 64)  # a partial file
    config = task_arithmetic_mergekit_config(env.checkpoints)
    return Api(lambda: merge_checkpoints(config, env.tmp / "merged"), warns=LeftoverWarning)


_IN_USE = r"`out_dir` \(--out\) '.*run' is in use by another mergecompose run \(pid \d+\)"

CASES = [
    Case("faults-compare-out-in-use", "data-loss", compare_folder_in_use, _IN_USE),
    Case("faults-compare-out-in-use-api", "data-loss", compare_folder_in_use_api, _IN_USE),
    Case("faults-skills-sweep-out-in-use", "data-loss", skills_sweep_folder_in_use, _IN_USE),
    Case("faults-overlap-sweep-out-in-use", "data-loss", overlap_sweep_folder_in_use, _IN_USE),
    Case(
        "faults-merge-leftover-of-killed-run",
        "data-loss",
        merge_over_a_killed_runs_leftover,
        r"removed .*\.merged\.tmp-\d+-0123abcd, left by a killed run \(pid \d+, no longer running\)",
    ),
]
