"""`--executor ray`: a scaled predict sweep run as Ray tasks on a local Ray instance of 2 CPUs gives the local run's
results; a worker killed in the middle of a cell, a cell that raises, a second driver, and Ray without its extra.
(The local Ray instance and the config: conftest.py. What is refused before any work, and Ctrl-C:
test_ray_refusals.py.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mergecompose.cli import main
from mergecompose.core.executor import Cell, LocalExecutor, run_cells
from mergecompose.core.locks import RUN_LOCK_NAME
from mergecompose.integrations.ray import RayExecutor, RayUnavailable
from mergecompose.integrations.ray import executor as ray_executor
from mergecompose.studies.predict import PredictConfig, run_predict_sweep
from mergecompose.studies.predict import predict_sweep as predict_module

ray = pytest.importorskip("ray")
# One torch thread in this process, and so in every Ray worker (a cell runs with the driver's thread count): two
# workers of two threads each on two cores spin against each other.
pytestmark = pytest.mark.usefixtures("one_torch_thread")

TIMINGS = {"seconds", "setting_seconds", "cells"}


def _sweep(config_file: Path, out: Path, executor) -> dict:
    config = PredictConfig.model_validate(yaml.safe_load(config_file.read_text()))
    return run_predict_sweep(config, out, progress=False, echo=None, config_path=config_file, executor=executor)


def _without_timings(results: dict) -> dict:
    results = {key: value for key, value in results.items() if key not in TIMINGS}
    results["settings"] = [{k: v for k, v in s.items() if k != "seconds"} for s in results["settings"]]
    return results


def test_a_predict_sweep_on_ray_gives_the_local_results(local_ray, config_file, tmp_path):
    local = _sweep(config_file, tmp_path / "local", LocalExecutor())
    on_ray = _sweep(config_file, tmp_path / "ray", local_ray)
    assert _without_timings(on_ray) == _without_timings(local)
    assert on_ray["cells"]["executor"] == "ray" and local["cells"]["executor"] == "local"
    assert set(on_ray["cells"]["runs"]) == {"letters/experts", "letters/ab_cd", "letters/ab_ac"}
    assert all(run["pid"] != os.getpid() for run in on_ray["cells"]["runs"].values())  # Ray's workers ran them
    assert all(run["pid"] == os.getpid() for run in local["cells"]["runs"].values())
    assert (tmp_path / "ray" / "predict.json").is_file()


def test_a_worker_killed_in_a_cell_is_run_again_and_its_result_written_once(local_ray, config_file, tmp_path):
    out = tmp_path / "run"
    _sweep(config_file, out, local_ray)
    (out / "settings" / "ab_ac.json").unlink()
    marker = tmp_path / "killed_once"
    config = PredictConfig.model_validate(yaml.safe_load(config_file.read_text()))

    def killed_in_the_middle(*args):
        """The real setting cell; on its first run its worker dies once the setting is measured, before the cell
        writes its record."""
        if not marker.exists():
            marker.write_text(str(os.getpid()))
            measure = predict_module.measure_setting

            def measure_then_die(*measure_args, **options):
                measure(*measure_args, **options)
                os._exit(1)

            predict_module.measure_setting = measure_then_die  # in this worker's process only
        return predict_module._setting_cell(*args)

    cells = [
        Cell(
            "letters/ab_ac",
            killed_in_the_middle,
            (config, "letters", "ab_ac", str(out), str(config_file)),
        )
    ]
    runs = run_cells(cells, local_ray, progress=False)
    assert runs["letters/ab_ac"].ok, runs["letters/ab_ac"].error
    assert int(marker.read_text()) != runs["letters/ab_ac"].where["pid"]  # the second worker finished it
    assert sorted(path.name for path in (out / "settings").iterdir()) == ["ab_ac.json", "ab_cd.json"]  # no leftover
    again = _sweep(config_file, out, local_ray)  # the rerun finds every cell's result
    assert [s["name"] for s in again["settings"]] == ["ab_cd", "ab_ac"]
    assert json.loads((out / "settings" / "ab_ac.json").read_text()) == again["settings"][1]


def test_a_cell_that_raises_stops_only_itself_and_the_rerun_runs_only_it(config_file, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    real = predict_module._setting_cell

    def fails_once(config, family, setting, *rest):
        if setting == "ab_ac":
            raise RuntimeError("this setting's measurement broke")
        return real(config, family, setting, *rest)

    monkeypatch.setattr(predict_module, "_setting_cell", fails_once)
    assert main(["predict-sweep", str(config_file), "--out", str(out), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "cell letters/ab_ac failed: RuntimeError: this setting's measurement broke" in err
    assert "1 cell(s) failed" in err
    assert (out / "settings" / "ab_cd.json").is_file() and not (out / "predict.json").exists()
    before = (out / "settings" / "ab_cd.json").stat().st_mtime_ns
    monkeypatch.setattr(predict_module, "_setting_cell", real)
    assert main(["predict-sweep", str(config_file), "--out", str(out), "--quiet"]) == 0
    assert (out / "settings" / "ab_cd.json").stat().st_mtime_ns == before  # not measured again
    assert (out / "settings" / "ab_ac.json").is_file()


def test_cells_on_ray_report_failures_and_skip_their_dependents(local_ray):
    def broken():
        raise ValueError("no data")

    cells = [
        Cell("a", int, ("3",)),
        Cell("b", broken),
        Cell("c", int, ("4",), after=("a",)),
        Cell("d", int, ("5",), after=("b",)),
    ]
    runs = run_cells(cells, local_ray, progress=False)
    assert [runs[name].value for name in "ac"] == [3, 4]
    assert runs["b"].error == "ValueError: no data"
    assert runs["d"].error == "not run: b failed"


def test_a_second_driver_on_the_folder_is_refused(config_file, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    hold = (
        "import fcntl, os, sys; descriptor = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(descriptor, fcntl.LOCK_EX); os.write(descriptor, str(os.getpid()).encode()); "
        "print('held', flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(out / RUN_LOCK_NAME)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["predict-sweep", str(config_file), "--out", str(out), "--executor", "ray"]) == 2
        assert f"is in use by another mergecompose run (pid {holder.pid})" in capsys.readouterr().err
    finally:
        holder.stdin.close()
        holder.wait()


def test_ray_without_the_extra_is_one_line(config_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ray_executor, "ray", None)
    with pytest.raises(RayUnavailable, match=r'pip install "\.\[ray\]"'):
        RayExecutor()
    assert main(["predict-sweep", str(config_file), "--out", str(tmp_path / "run"), "--executor", "ray"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        'mergecompose predict-sweep: error: the Ray executor needs Ray: pip install ".[ray]" (make install installs it)'
    ]


def test_an_address_with_no_cluster_is_one_line_within_the_timeout(config_file, tmp_path, capsys):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens here once the probe is closed
    started = time.monotonic()
    argv = ["predict-sweep", str(config_file), "--out", str(tmp_path / "run"), "--executor", "ray"]
    assert main([*argv, "--ray-address", f"127.0.0.1:{port}"]) == 2
    assert time.monotonic() - started < ray_executor.CONNECT_TIMEOUT_S + 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"`--ray-address` '127.0.0.1:{port}': no Ray cluster answers there" in err[0]
    assert not (tmp_path / "run").exists()  # refused before anything was written
