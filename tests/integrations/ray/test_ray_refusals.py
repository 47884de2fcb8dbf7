"""`--executor ray` never waits without end: what is refused before any work, in one line that names the address's
source (cells asking for more than a node has, addresses that are malformed, closed, or not Ray), and Ctrl-C, which
cancels the tasks in flight. On the folder's local Ray instance of 2 CPUs (conftest.py); a real HTTP server and a
real silent TCP listener stand for what is not Ray."""

from __future__ import annotations

import http.server
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import yaml

from mergecompose.cli import main
from mergecompose.core.executor import Cell, Resources, run_cells
from mergecompose.integrations.ray import RayExecutor, RayUnavailable
from mergecompose.integrations.ray import executor as ray_executor

ray = pytest.importorskip("ray")
autoscaler_pb2 = pytest.importorskip("ray.core.generated.autoscaler_pb2")
internal_kv = pytest.importorskip("ray.experimental.internal_kv")

CPU_ONLY = "GPU: 0 on the largest node, 0 in all over 1 node"
# Ctrl-C: how long two Ray workers may take to start on a loaded machine (`make test` runs two test files at once
# on 2 cores), and how soon the interrupt, the workers' death and the freed CPUs must follow; both far below the
# cells' 600 s of sleep, which a Ctrl-C that cancelled nothing would wait out.
STARTUP_S = 300
CANCEL_S = 10
TWO_CPUS = "CPU: 2 on the largest node, 2 in all over 1 node"


@pytest.fixture(autouse=True)
def no_ray_address(monkeypatch):
    """RAY_ADDRESS of the environment running the tests must not choose the cluster here."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


@pytest.fixture
def http_server():
    """A real HTTP server on a free port of this machine: something listens, and it is not Ray."""

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def silent_listener():
    """A TCP listener that accepts connections and never says a word."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield f"127.0.0.1:{listener.getsockname()[1]}"


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # nothing listens here once the probe is closed


def _cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    """The command's exit status and its stderr lines."""
    status = main(argv)
    return status, capsys.readouterr().err.strip().splitlines()


def _touch(path: str) -> str:
    Path(path).write_text("ran")
    return path


# What a cell asks of the cluster


def test_a_cell_asking_for_a_gpu_on_a_cpu_only_cluster_is_refused_before_any_cell_is_submitted(local_ray, tmp_path):
    marker = tmp_path / "first_cell_ran"
    cells = [Cell("fits", _touch, (str(marker),)), Cell("gpu", int, ("1",), Resources(num_gpus=1))]
    started = time.monotonic()
    with pytest.raises(RayUnavailable) as refused:
        run_cells(cells, local_ray, progress=False)
    assert time.monotonic() - started < 2  # no waiting
    assert str(refused.value) == (
        f"cell 'gpu' asks for num_gpus=1, more than any node of the local Ray instance has now ({CPU_ONLY}): its "
        "task would wait without end; lower the config's `resources` or use a cluster with such a node"
    )
    run_cells([Cell("after", int, ("2",))], local_ray, progress=False)  # a task submitted before would have run
    assert not marker.exists()


def test_a_cell_asking_for_more_cpus_than_a_node_has_is_refused(local_ray):
    cells = [Cell(f"wide{index}", int, ("1",), Resources(num_cpus=3)) for index in range(3)]
    with pytest.raises(RayUnavailable, match=r"^cell 'wide0' asks for num_cpus=3, more than any node") as refused:
        run_cells(cells, local_ray, progress=False)
    assert f"({TWO_CPUS}; 2 more cell(s) likewise)" in str(refused.value)


def test_a_config_whose_cells_ask_for_a_gpu_is_one_line_on_the_command_line(local_ray, config_file, tmp_path, capsys):
    config = tmp_path / "gpu.yaml"
    asks_for_a_gpu = {**yaml.safe_load(config_file.read_text()), "resources": {"cell": {"num_gpus": 1}}}
    config.write_text(yaml.safe_dump(asks_for_a_gpu))
    out = tmp_path / "run"
    status, err = _cli(["predict-sweep", str(config), "--out", str(out), "--executor", "ray", "--quiet"], capsys)
    assert status == 2
    assert err == [
        "mergecompose predict-sweep: error: cell 'letters/ab_cd' asks for num_gpus=1, more than any node of the local "
        f"Ray instance has now ({CPU_ONLY}; 1 more cell(s) likewise): its task would wait without end; lower the "
        "config's `resources` or use a cluster with such a node"
    ]
    assert not (out / "checkpoints").exists()  # not even the experts' cell, which fits, ran


def test_the_resources_are_compared_with_the_largest_node_and_the_total():
    nodes = [{"CPU": 8.0}, {"CPU": 4.0, "GPU": 1.0}]
    fits = [Cell("cpu", int, resources=Resources(8, 0)), Cell("gpu", int, resources=Resources(4, 1))]
    ray_executor.check_resources(fits, nodes, False, "the cluster")  # each on one node: no message
    with pytest.raises(RayUnavailable) as refused:
        ray_executor.check_resources([Cell("both", int, resources=Resources(8, 1))], nodes, False, "the cluster")
    assert str(refused.value).startswith(
        "cell 'both' asks for num_cpus=8 and num_gpus=1, more than any node of the cluster has now (CPU: 8 on the "
        "largest node, 12 in all over 2 nodes; GPU: 1 on the largest node, 1 in all over 2 nodes; not all on one node)"
    )
    with pytest.raises(RayUnavailable, match=r"asks for num_gpus=2, .*\(GPU: 1 on the largest node, 1 in all"):
        ray_executor.check_resources([Cell("two", int, resources=Resources(1, 2))], nodes, False, "the cluster")


@pytest.mark.parametrize(
    ("can_add_nodes", "reason"),
    [(True, "its autoscaler can add nodes"), (None, "it may add nodes (not known through ray://)")],
)
def test_a_cluster_that_can_add_nodes_gets_a_warning_instead(can_add_nodes, reason):
    cells = [Cell("gpu", int, resources=Resources(1, 1))]
    with pytest.warns(UserWarning) as warned:
        ray_executor.check_resources(cells, [{"CPU": 2.0}], can_add_nodes, "the cluster")
    assert [str(warning.message) for warning in warned] == [
        "cell 'gpu' asks for num_gpus=1, more than any node of the cluster has now (GPU: 0 on the largest node, 0 in "
        f"all over 1 node); {reason}, so the cells are submitted and wait for one"
    ]


def test_a_cluster_can_add_nodes_where_its_autoscaler_reports_a_node_type_that_scales(local_ray):
    """The report an autoscaler writes into the cluster's GCS, written here into the local instance's."""
    key, namespace = ray._raylet.GCS_AUTOSCALER_CLUSTER_CONFIG_KEY, ray._raylet.GCS_AUTOSCALER_STATE_NAMESPACE
    assert ray_executor.cluster_can_add_nodes() is False  # a local instance: no autoscaler
    for min_count, max_count, scales in [(0, 4, True), (0, -1, True), (2, 2, False)]:
        group = autoscaler_pb2.NodeGroupConfig(
            name="gpu", resources={"CPU": 8, "GPU": 1}, min_count=min_count, max_count=max_count
        )
        config = autoscaler_pb2.ClusterConfig(node_group_configs=[group])
        internal_kv._internal_kv_put(key, config.SerializeToString(), overwrite=True, namespace=namespace)
        try:
            assert ray_executor.cluster_can_add_nodes() is scales
        finally:
            internal_kv._internal_kv_del(key, namespace=namespace)


# The address


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("127.0.0.1:70000", "`--ray-address` '127.0.0.1:70000': the port must be in [1, 65535], got 70000"),
        ("head:0", "`--ray-address` 'head:0': the port must be in [1, 65535], got 0"),
        ("head:port", "`--ray-address` 'head:port': the port must be a number in [1, 65535], got 'port'"),
        ("head:", "`--ray-address` 'head:': the port must be a number in [1, 65535], got ''"),
        (":6379", "`--ray-address` ':6379' is not host:port or ray://host:port (e.g. 10.0.0.1:6379)"),
        ("head", "`--ray-address` 'head' is not host:port or ray://host:port (e.g. 10.0.0.1:6379)"),
        ("", "`--ray-address` '' is not host:port or ray://host:port (e.g. 10.0.0.1:6379)"),
    ],
)
def test_a_malformed_address_is_refused_as_such(address, message):
    with pytest.raises(RayUnavailable) as refused:
        RayExecutor(address, address_name="--ray-address")
    assert str(refused.value) == message


def test_a_port_out_of_range_is_a_bad_address_on_the_command_line(config_file, tmp_path, capsys):
    argv = ["predict-sweep", str(config_file), "--out", str(tmp_path / "run"), "--executor", "ray"]
    status, err = _cli([*argv, "--ray-address", "127.0.0.1:70000"], capsys)
    assert (status, err) == (
        2,
        [
            "mergecompose predict-sweep: error: `--ray-address` '127.0.0.1:70000': the port must be in [1, 65535], "
            "got 70000"
        ],
    )


def test_an_address_from_ray_address_is_named_as_such(config_file, tmp_path, monkeypatch, capsys):
    port = _closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    argv = ["predict-sweep", str(config_file), "--out", str(tmp_path / "run"), "--executor", "ray"]
    status, err = _cli(argv, capsys)
    assert status == 2 and len(err) == 1
    assert err[0].startswith(
        f"mergecompose predict-sweep: error: `RAY_ADDRESS` '127.0.0.1:{port}': no Ray cluster answers there within "
        "10 s ("
    )
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:70000")  # the flag, where given, is the address and its name
    status, err = _cli([*argv, "--ray-address", f"127.0.0.1:{port}"], capsys)
    assert status == 2 and err[0].startswith(f"mergecompose predict-sweep: error: `--ray-address` '127.0.0.1:{port}'")
    status, err = _cli(argv, capsys)
    assert err == [
        "mergecompose predict-sweep: error: `RAY_ADDRESS` '127.0.0.1:70000': the port must be in [1, 65535], got 70000"
    ]


def test_an_http_server_at_the_address_is_one_line_within_the_timeout(config_file, http_server, tmp_path, capsys):
    argv = ["predict-sweep", str(config_file), "--out", str(tmp_path / "run"), "--executor", "ray"]
    started = time.monotonic()
    status, err = _cli([*argv, "--ray-address", http_server], capsys)
    assert time.monotonic() - started < ray_executor.CONNECT_TIMEOUT_S
    assert status == 2 and len(err) == 1
    assert err[0].startswith(
        f"mergecompose predict-sweep: error: `--ray-address` '{http_server}': something listens there, but it is not "
        "a Ray cluster's GCS (is it the head node's GCS port, 6379 by default?); Ray's GCS client: "
    )
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_listener_that_never_answers_is_refused_when_the_probe_runs_out_of_time(silent_listener):
    address = ray_executor.RayAddress.parse(silent_listener, "RAY_ADDRESS")
    started = time.monotonic()
    with pytest.raises(RayUnavailable) as refused:
        ray_executor.probe_ray(address, remaining=1.0, timeout=1.0)
    assert time.monotonic() - started < 1.5
    assert str(refused.value) == (
        f"`RAY_ADDRESS` '{silent_listener}': something listens there, but no Ray GCS answered within 1 s (is it the "
        "head node's GCS port, 6379 by default?)"
    )


def test_the_address_of_a_ray_cluster_passes_the_probe(local_ray):
    gcs = ray.get_runtime_context().gcs_address
    executor = RayExecutor(gcs, address_name="--ray-address")  # checked, in well under the timeout
    assert executor.cluster == f"the Ray cluster at `--ray-address` {gcs!r}"


def test_a_ray_client_address_without_the_ray_client_is_one_line(monkeypatch, http_server):
    monkeypatch.setattr(ray_executor, "grpc", None)  # as where `ray[client]` is not installed
    with pytest.raises(RayUnavailable) as refused:
        RayExecutor(f"ray://{http_server}", address_name="--ray-address")
    assert str(refused.value) == (
        f"`--ray-address` 'ray://{http_server}': a Ray Client address (ray://) needs the Ray Client: "
        'pip install "ray[client]" (same version as ray)'
    )


# Ctrl-C


def _running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_ctrl_c_cancels_the_tasks_in_flight_and_propagates(local_ray, tmp_path):
    def slow(name: str, folder: str) -> None:
        """Record this worker's pid, then wait far longer than the test (unless released): a cell running when
        Ctrl-C comes."""
        Path(folder, f"{name}.started").write_text(str(os.getpid()))
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not Path(folder, "release").exists():
            time.sleep(0.1)
        Path(folder, f"{name}.finished").write_text("finished")

    cells = [Cell(name, slow, (name, str(tmp_path))) for name in "abc"]  # two run at once on 2 CPUs, one waits
    interrupted: list[float] = []
    raised = threading.Event()

    def press_ctrl_c() -> None:
        """Ctrl-C (a real SIGINT to this process) once two cells run; on a machine so loaded that two workers have
        not started after STARTUP_S, Ctrl-C all the same (the test then fails on the count below). Where no
        KeyboardInterrupt follows within CANCEL_S, the cells are released so that the test fails now, not after
        their 600 s."""
        deadline = time.monotonic() + STARTUP_S
        while len(list(tmp_path.glob("*.started"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        interrupted.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)
        if not raised.wait(CANCEL_S):
            Path(tmp_path, "release").write_text("")

    # Ctrl-C's Python handler, whatever an earlier test in this process left (a test runner may leave SIGINT to
    # the default action, which would kill the process instead of raising KeyboardInterrupt).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    presser = threading.Thread(target=press_ctrl_c, daemon=True)
    try:
        presser.start()
        with pytest.raises(KeyboardInterrupt):
            try:
                run_cells(cells, local_ray, progress=False)
            except KeyboardInterrupt:
                raised.set()
                raise
        presser.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - interrupted[0] < CANCEL_S
    started = sorted(path.name for path in tmp_path.glob("*.started"))
    assert len(started) == 2, f"two cells should run at once on the 2 CPUs within {STARTUP_S} s, got {started}"
    pids = [int((tmp_path / name).read_text()) for name in started]
    deadline = time.monotonic() + CANCEL_S
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_running(pid) for pid in pids)  # force: the workers killed, not interrupted
    run_cells([Cell("after", int, ("1",))], local_ray, progress=False)  # a waiting task not cancelled would start
    deadline = time.monotonic() + CANCEL_S
    while ray.available_resources().get("CPU") != 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # the lease of "after", and the view of resources, catch up
    assert ray.available_resources().get("CPU") == 2  # no task of the interrupted run holds a CPU
    assert sorted(path.name for path in tmp_path.iterdir()) == started
