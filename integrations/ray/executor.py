"""`RayExecutor`: each cell a Ray task that asks for its resources; dependencies as Ray object references.

Before any work, nothing that would wait without end:

* **The address** (`--ray-address`, else `RAY_ADDRESS`, else a local Ray instance started here) is checked within
  `CONNECT_TIMEOUT_S` in all, each message naming where the address came from: its form (`host:port` with a port
  in [1, 65535], or `ray://host:port`), a TCP connection, then proof that Ray answers there (`probe_ray`): a GCS
  address must give Ray's own GCS client its cluster id, a Ray Client address must answer the Ray Client's ping.
  Anything else (an HTTP server, any other listener) would leave `ray.init` waiting; here it is one line.
* **The resources**: once connected, each cell's `num_cpus`/`num_gpus` is compared with the cluster's alive nodes
  (`check_resources`) before any cell is submitted. A cell no node can hold would pend forever: refused, in one
  line, unless the cluster can add nodes (its autoscaler reports node types that can scale up), then a warning.

While the cells run:

* A cell runs with the driver's torch thread count (`run_in_worker`); its seeds are its own arguments, so the
  results do not depend on the executor.
* Retries: `max_retries=1` for a task whose worker died (Ray's system failures) and none for an exception the cell
  raised. A cell writes its result atomically through its command's cache and reads it back where it is there
  already, so a cell run again after its worker died either finds nothing (it died before writing) or its own
  finished result: a cell never has two results.
* A cell whose dependency failed is reported as not run; the others go on.
* Ctrl-C (KeyboardInterrupt) cancels the unfinished tasks, then propagates: finished cells are in the run folder,
  and a rerun runs only the others.

Ray is an optional extra (`pip install ".[ray]"`): without it this module imports, and `RayExecutor()` raises
`RayUnavailable`, one line naming the extra.
"""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from mergecompose.core.executor import Cell, CellRun, one_line, run_in_worker

try:
    import ray
except ImportError:  # the optional extra
    ray = None
try:  # what `ray.init("ray://...")` needs: the `ray[client]` extra of Ray
    import grpc
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import ray_client_pb2, ray_client_pb2_grpc
except ImportError:
    grpc = None

CONNECT_TIMEOUT_S = 10.0
PROBE_CLOSE_S = 0.5  # of CONNECT_TIMEOUT_S, kept for ending a probe that timed out (killing it, closing its channel)
RAY_EXTRA = 'the Ray executor needs Ray: pip install ".[ray]" (make install installs it)'
CLIENT_EXTRA = 'a Ray Client address (ray://) needs the Ray Client: pip install "ray[client]" (same version as ray)'
# A cell's resources as Ray names them on a node.
NODE_RESOURCES = {"num_cpus": "CPU", "num_gpus": "GPU"}

# Ray's own GCS client (`ray status` connects with it) in a child process: in this process its waits are fixed
# (5 s per connection attempt, 30 s for the cluster id, read once per process from RAY_* variables) and it logs to
# stderr. The child gets shorter waits, its stderr is kept, and `subprocess.run(timeout=...)` bounds it.
_GCS_PROBE = "import sys; from ray._raylet import GcsClient; print(GcsClient(address=sys.argv[1]).cluster_id.hex())"
_GCS_PROBE_WAITS = {"RAY_gcs_rpc_server_connect_timeout_s": "1", "RAY_py_gcs_connect_timeout_s": "3"}


class RayUnavailable(ValueError):
    """Ray cannot run this command's cells: not installed, no Ray cluster at the address, or a cell asking for more
    than any node of the cluster has."""


@dataclass(frozen=True)
class RayAddress:
    """A Ray cluster's address, `host:port` (its GCS) or `ray://host:port` (a Ray Client server), with the flag or
    variable it came from (`--ray-address`, `RAY_ADDRESS`), which every message about it names."""

    text: str
    source: str
    host: str
    port: int

    @property
    def is_client(self) -> bool:
        return self.text.startswith("ray://")

    def __str__(self) -> str:
        return f"`{self.source}` {self.text!r}"

    @classmethod
    def parse(cls, text: str, source: str) -> RayAddress:
        """`text` split into host and port; a bad form, an empty host, or a port outside [1, 65535] is refused."""
        named = f"`{source}` {text!r}"
        host, colon, port = text.removeprefix("ray://").rpartition(":")
        host = host.removeprefix("[").removesuffix("]")  # [::1]:6379
        if not colon or not host or any(character.isspace() for character in host):
            raise RayUnavailable(f"{named} is not host:port or ray://host:port (e.g. 10.0.0.1:6379)")
        if not port.isdigit():
            raise RayUnavailable(f"{named}: the port must be a number in [1, 65535], got {port!r}")
        if not 1 <= int(port) <= 65535:
            raise RayUnavailable(f"{named}: the port must be in [1, 65535], got {int(port)}")
        return cls(text, source, host, int(port))


def address_and_source(address: str | None, address_name: str) -> tuple[str | None, str]:
    """The cluster to join and the name messages give it: `address` (named `address_name`), else `RAY_ADDRESS`
    where it is set, else None (a local instance)."""
    if address is None and os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    return address, address_name


class RayExecutor:
    """Run cells as Ray tasks on the cluster at `address` (else `RAY_ADDRESS`, else a local instance of `num_cpus`).

    `address_name` is how messages name `address` (the command line passes `--ray-address`). The address is
    checked here, within `CONNECT_TIMEOUT_S`, before any work; Ray's keywords `local` (a local instance) and `auto`
    (the cluster `ray start` left on this machine, which `ray.init` finds) are not addresses to check."""

    name = "ray"

    def __init__(self, address: str | None = None, num_cpus: int | None = None, address_name: str = "address"):
        if ray is None:
            raise RayUnavailable(RAY_EXTRA)
        self.address, self.source = address_and_source(address, address_name)
        self.num_cpus = num_cpus
        if self.address not in (None, "local", "auto"):
            check_reachable(RayAddress.parse(self.address, self.source))

    @property
    def cluster(self) -> str:
        """The cluster as messages name it, with where its address came from."""
        if self.address in (None, "local"):
            return "the local Ray instance"
        return f"the Ray cluster at `{self.source}` {self.address!r}"

    def start(self) -> None:
        if ray.is_initialized():
            return
        if self.address in (None, "local"):
            # "local": a new instance, even where another runs on this machine (Ray would join it otherwise).
            ray.init(
                address="local",
                num_cpus=self.num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
            return
        try:
            ray.init(address=self.address, log_to_driver=False, configure_logging=False)
        except Exception as error:  # a version mismatch, a refused token, ...: Ray's reason, one line
            raise RayUnavailable(f"cannot join {self.cluster}: {one_line(error)}") from error

    def run(self, cells: Sequence[Cell], on_done: Callable[[CellRun], None]) -> dict[str, CellRun]:
        """Check every cell's resources against the cluster, then submit them all and collect them as they finish.
        A KeyboardInterrupt cancels the tasks not yet finished, then propagates."""
        self.start()
        check_resources(cells, alive_nodes(), cluster_can_add_nodes(), self.cluster)
        refs: dict[str, object] = {}
        runs: dict[str, CellRun] = {}
        try:
            _submit(cells, refs)
            _collect(cells, refs, runs, on_done)
        except KeyboardInterrupt:
            cancel([ref for name, ref in refs.items() if name not in runs])
            raise
        return runs


def _submit(cells: Sequence[Cell], refs: dict[str, object]) -> None:
    """Each cell as a Ray task asking for its resources, after the tasks it waits for; `refs` filled as it goes,
    so an interrupt in the middle leaves the submitted ones to cancel."""
    threads = torch.get_num_threads()
    remote = ray.remote(_run_after)
    for cell in cells:
        task = remote.options(
            name=cell.name,
            num_cpus=cell.resources.num_cpus,
            num_gpus=cell.resources.num_gpus,
            max_retries=1,  # only a worker that died, never an exception the cell raised
            retry_exceptions=False,
        )
        refs[cell.name] = task.remote(cell.function, cell.args, threads, *(refs[name] for name in cell.after))


def _collect(
    cells: Sequence[Cell], refs: dict[str, object], runs: dict[str, CellRun], on_done: Callable[[CellRun], None]
) -> None:
    """Each task's outcome into `runs` as it finishes: its value, its error, or "not run" after a failed dependency."""
    names = {ref: name for name, ref in refs.items()}
    after = {cell.name: cell.after for cell in cells}
    remaining = list(refs.values())
    while remaining:
        done, remaining = ray.wait(remaining, num_returns=1)
        for ref in done:
            name = names[ref]
            failed = [dependency for dependency in after[name] if not runs[dependency].ok]
            try:
                outcome = ray.get(ref)
                run = CellRun(name, value=outcome["value"], where=outcome["where"])
            except ray.exceptions.RayTaskError as error:
                if failed:
                    run = CellRun(name, error=f"not run: {failed[0]} failed")
                else:
                    cause = error.cause if isinstance(error.cause, BaseException) else error
                    run = CellRun(name, error=one_line(cause), details=str(error))
            except ray.exceptions.RayError as error:  # the worker died twice, the node was lost, ...
                run = CellRun(name, error=one_line(error), details=str(error))
            runs[name] = run
            on_done(run)


def cancel(refs: Sequence[object]) -> None:
    """Cancel the tasks of `refs` (and the tasks they started): those waiting never run, those running stop now.

    `force=True` kills a running task's worker process instead of raising KeyboardInterrupt inside the cell, which
    a cell inside a long C or CUDA call (a model load, a generate, a merge) would only see when that call returns,
    holding its GPU until then. Killing is safe for cells: each writes its result atomically, as a worker's death
    (retried, `max_retries=1`) already requires; Ray does not retry a cancelled task."""
    for ref in refs:
        ray.cancel(ref, force=True)


def _run_after(function, args, threads, *dependencies):
    """A cell in a Ray worker, once the cells it waits for (`dependencies`, resolved by Ray) have finished."""
    return run_in_worker(function, args, threads)


def alive_nodes() -> list[dict[str, float]]:
    """The resources (`CPU`, `GPU`, ...) of each alive node of the connected cluster."""
    return [dict(node["Resources"]) for node in ray.nodes() if node["Alive"]]


def cluster_can_add_nodes() -> bool | None:
    """Whether the connected cluster can add nodes: True where its autoscaler reports a node type that can scale
    up (`max_count` unlimited or above `min_count`), as Ray Data decides it (`is_autoscaling_enabled`); False
    where no autoscaler reports one (a fixed cluster, a local instance). None through a Ray Client (`ray://`),
    which cannot read that report."""
    if ray.util.client.ray.is_connected():
        return None
    config = ray._private.state.state.get_cluster_config()
    groups = config.node_group_configs if config is not None else ()
    return any(
        group.max_count == -1 or group.max_count > group.min_count
        for group in groups
        if group.resources and group.max_count != 0
    )


def check_resources(
    cells: Sequence[Cell], nodes: Sequence[Mapping[str, float]], can_add_nodes: bool | None, cluster: str
) -> None:
    """Refuse cells that no node of `nodes` can hold (their tasks would pend forever), in one line naming the first
    such cell, the resource, what it asks and what the cluster has (the largest node's and the total). Where the
    cluster can add nodes (`can_add_nodes`; None: not known), a warning instead: a new node may hold them."""
    unmet = [(cell, shortfall) for cell in cells if (shortfall := _shortfall(cell, nodes)) is not None]
    if not unmet:
        return
    cell, (wanted, has) = unmet[0]
    more = f"; {len(unmet) - 1} more cell(s) likewise" if len(unmet) > 1 else ""
    message = f"cell {cell.name!r} asks for {wanted}, more than any node of {cluster} has now ({has}{more})"
    if can_add_nodes is False:
        raise RayUnavailable(
            f"{message}: its task would wait without end; lower the config's `resources` or use a cluster with "
            "such a node"
        )
    reason = "its autoscaler can add nodes" if can_add_nodes else "it may add nodes (not known through ray://)"
    warnings.warn(f"{message}; {reason}, so the cells are submitted and wait for one", UserWarning, stacklevel=2)


def _shortfall(cell: Cell, nodes: Sequence[Mapping[str, float]]) -> tuple[str, str] | None:
    """What `cell` asks that no single node of `nodes` has, and what they have, e.g. (`num_gpus=1`, `GPU: 0 on the
    largest node, 0 in all over 1 node`); None where some node has all of it."""
    asked = {resource: getattr(cell.resources, key) for key, resource in NODE_RESOURCES.items()}
    asked = {resource: amount for resource, amount in asked.items() if amount > 0}
    if not asked or any(all(node.get(name, 0) >= amount for name, amount in asked.items()) for node in nodes):
        return None
    largest = {resource: max((node.get(resource, 0) for node in nodes), default=0) for resource in asked}
    short = [resource for resource, amount in asked.items() if largest[resource] < amount]
    named = short or list(asked)  # each on some node, but no node with all of them
    keys = {resource: key for key, resource in NODE_RESOURCES.items()}
    wanted = " and ".join(f"{keys[resource]}={asked[resource]:g}" for resource in named)
    nodes_count = f"{len(nodes)} node" + ("s" if len(nodes) != 1 else "")
    has = "; ".join(
        f"{resource}: {largest[resource]:g} on the largest node, "
        f"{sum(node.get(resource, 0) for node in nodes):g} in all over {nodes_count}"
        for resource in named
    )
    return wanted, has if short else f"{has}; not all on one node"


def check_reachable(address: RayAddress, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse `address` unless a Ray cluster answers there within `timeout` in all: a TCP connection first (nothing
    listening, an unknown host, a filtered port), then `probe_ray` (something listening that is not Ray)."""
    deadline = time.monotonic() + timeout - PROBE_CLOSE_S
    try:
        with socket.create_connection((address.host, address.port), timeout=timeout):
            pass
    except socket.gaierror as error:
        raise RayUnavailable(f"{address}: the host {address.host!r} is not known ({error.strerror or error})") from None
    except OSError as error:
        raise RayUnavailable(
            f"{address}: no Ray cluster answers there within {timeout:g} s ({error.strerror or error})"
        ) from None
    probe_ray(address, deadline - time.monotonic(), timeout)


def probe_ray(address: RayAddress, remaining: float, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse `address` unless Ray answers there within `remaining` seconds: a GCS address must give Ray's GCS client
    its cluster id (`_GCS_PROBE`, what `ray status` connects with); a `ray://` address must answer the Ray Client's
    ping (`ClusterInfo` of type PING, what `ray.init("ray://...")` waits for)."""
    if address.is_client:
        _probe_client_server(address, remaining, timeout)
    else:
        _probe_gcs(address, remaining, timeout)


def _probe_gcs(address: RayAddress, remaining: float, timeout: float) -> None:
    """Ray's GCS client, in a child process bounded by `remaining` seconds, must read the cluster id at `address`."""
    target = f"[{address.host}]:{address.port}" if ":" in address.host else f"{address.host}:{address.port}"
    environment = {**os.environ, **_GCS_PROBE_WAITS}
    try:
        probe = subprocess.run(
            [sys.executable, "-c", _GCS_PROBE, target],
            capture_output=True,
            text=True,
            env=environment,
            timeout=max(remaining, 0.1),
        )
    except subprocess.TimeoutExpired:
        raise RayUnavailable(
            f"{address}: something listens there, but no Ray GCS answered within {timeout:g} s (is it the head "
            "node's GCS port, 6379 by default?)"
        ) from None
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
        reason = reason.removeprefix("ray.exceptions.")
        raise RayUnavailable(
            f"{address}: something listens there, but it is not a Ray cluster's GCS (is it the head node's GCS port, "
            f"6379 by default?); Ray's GCS client: {reason}"
        )


def _probe_client_server(address: RayAddress, remaining: float, timeout: float) -> None:
    """The Ray Client server at `address` must answer a ping within `remaining` seconds, over the channel Ray's
    client opens (TLS and token authentication as configured in the environment)."""
    if grpc is None:
        raise RayUnavailable(f"{address}: {CLIENT_EXTRA}")
    deadline = time.monotonic() + remaining
    channel = init_grpc_channel(f"{address.host}:{address.port}", asynchronous=False)
    try:
        state = _first_settled_state(channel, remaining)
        if state is not grpc.ChannelConnectivity.READY:
            what = "not a gRPC server" if state is not None else f"no gRPC server answered within {timeout:g} s"
            raise RayUnavailable(
                f"{address}: something listens there, but {what} (a Ray Client server is one; is it the head node's "
                "Ray Client port, 10001 by default?)"
            )
        ping = ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING)
        ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(ping, timeout=max(deadline - time.monotonic(), 0.1))
    except grpc.RpcError as error:
        raise RayUnavailable(
            f"{address}: a gRPC server answers there, but not a Ray Client server (is it the head node's Ray Client "
            f"port, 10001 by default?): {error.code().name} {error.details() or ''}".rstrip()
        ) from None
    finally:
        channel.close()


def _first_settled_state(channel, timeout: float):
    """READY, or TRANSIENT_FAILURE (the connection failed, e.g. an HTTP/1 server refusing gRPC's handshake), as
    soon as `channel` reaches either; None where it is still connecting after `timeout` seconds."""
    settled: queue.Queue = queue.Queue()
    ends = (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE)

    def seen(state) -> None:
        if state in ends:
            settled.put(state)

    channel.subscribe(seen, try_to_connect=True)
    try:
        return settled.get(timeout=max(timeout, 0.1))
    except queue.Empty:
        return None
    finally:
        channel.unsubscribe(seen)
