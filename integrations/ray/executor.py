"""`RayExecutor`: each cell a Ray task that asks for its resources; dependencies as Ray object references.

* `ray.init(address=...)`: `--ray-address`, else `RAY_ADDRESS`, else a local Ray instance started here. An address
  is checked first with a plain TCP connection (`CONNECT_TIMEOUT_S`): no cluster behind it is one line, not a hang.
* A cell runs with the driver's torch thread count (`run_in_worker`); its seeds are its own arguments, so the
  results do not depend on the executor.
* Retries: `max_retries=1` for a task whose worker died (Ray's system failures) and none for an exception the cell
  raised. A cell writes its result atomically through its command's cache and reads it back where it is there
  already, so a cell run again after its worker died either finds nothing (it died before writing) or its own
  finished result: a cell never has two results.
* A cell whose dependency failed is reported as not run; the others go on.

Ray is an optional extra (`pip install ".[ray]"`): without it this module imports, and `RayExecutor()` raises
`RayUnavailable`, one line naming the extra.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence

import torch

from mergecompose.core.executor import Cell, CellRun, one_line, run_in_worker

try:
    import ray
except ImportError:  # the optional extra
    ray = None

CONNECT_TIMEOUT_S = 10.0
RAY_EXTRA = 'the Ray executor needs Ray: pip install ".[ray]" (make install installs it)'


class RayUnavailable(ValueError):
    """`--executor ray` without Ray installed, or an address with no Ray cluster behind it."""


class RayExecutor:
    """Run cells as Ray tasks on the cluster at `address` (else `RAY_ADDRESS`, else a local instance of `num_cpus`)."""

    name = "ray"

    def __init__(self, address: str | None = None, num_cpus: int | None = None):
        if ray is None:
            raise RayUnavailable(RAY_EXTRA)
        self.address = address or os.environ.get("RAY_ADDRESS") or None
        self.num_cpus = num_cpus
        if self.address not in (None, "auto", "local"):
            check_reachable(self.address)

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
        else:
            ray.init(address=self.address, log_to_driver=False, configure_logging=False)

    def run(self, cells: Sequence[Cell], on_done: Callable[[CellRun], None]) -> dict[str, CellRun]:
        self.start()
        threads = torch.get_num_threads()
        remote = ray.remote(_run_after)
        refs: dict[str, object] = {}
        for cell in cells:
            task = remote.options(
                name=cell.name,
                num_cpus=cell.resources.num_cpus,
                num_gpus=cell.resources.num_gpus,
                max_retries=1,  # only a worker that died, never an exception the cell raised
                retry_exceptions=False,
            )
            refs[cell.name] = task.remote(cell.function, cell.args, threads, *(refs[name] for name in cell.after))
        names = {ref: name for name, ref in refs.items()}
        after = {cell.name: cell.after for cell in cells}
        runs: dict[str, CellRun] = {}
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
        return runs


def _run_after(function, args, threads, *dependencies):
    """A cell in a Ray worker, once the cells it waits for (`dependencies`, resolved by Ray) have finished."""
    return run_in_worker(function, args, threads)


def check_reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse an address (`host:port`, optionally `ray://host:port`) where nothing answers within `timeout`."""
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise RayUnavailable(f"`--ray-address` {address!r} is not host:port (e.g. 10.0.0.1:6379)")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as error:
        raise RayUnavailable(
            f"`--ray-address` {address!r}: no Ray cluster answers there within {timeout:g} s "
            f"({error.strerror or error})"
        ) from None
