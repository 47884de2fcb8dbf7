"""`--executor local|ray` and `--ray-address`: the flags of the commands that cache per cell (`compare` with
`type: lm_eval`, `predict-sweep`), and the executor they choose (`mergecompose.core.executor`)."""

from __future__ import annotations

import argparse

from mergecompose.core.executor import EXECUTORS, Executor, LocalExecutor
from mergecompose.integrations.ray import RayExecutor


def add_executor_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="local",
        help="where the cells run: here, one after another (local, the default), or as Ray tasks (ray; needs the "
        "[ray] extra and a run folder every worker sees)",
    )
    parser.add_argument(
        "--ray-address",
        metavar="HOST:PORT",
        help="the Ray cluster of --executor ray: its GCS (head node, port 6379 by default) or ray://HOST:PORT (a Ray "
        "Client server); default: $RAY_ADDRESS, else a local Ray instance. Checked within 10 s before any work",
    )


def executor_from_flags(args: argparse.Namespace) -> Executor:
    """The executor the flags ask for, checked now (Ray installed; the address well formed and a Ray cluster
    answering there within `CONNECT_TIMEOUT_S`), before any work. Messages name the address's source:
    `--ray-address`, or `RAY_ADDRESS` where the flag is not given."""
    if args.executor == "ray":
        return RayExecutor(args.ray_address, address_name="--ray-address")
    if args.ray_address is not None:
        raise ValueError(f"`--ray-address` {args.ray_address!r} is for --executor ray; this run's executor is local")
    return LocalExecutor()
