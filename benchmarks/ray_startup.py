"""What Ray costs before the first cell: `ray.init` of a local instance, its first workers, and a cell on a warm
worker against calling the same function here (a ratio, in the same process).

    .venv/bin/python -m benchmarks.ray_startup
"""

from __future__ import annotations

import argparse
import statistics
import time

from mergecompose.core.executor import Cell, LocalExecutor, run_cells
from mergecompose.integrations.ray import RayExecutor


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpus", type=int, default=2, help="the local Ray instance's CPUs (and first workers)")
    parser.add_argument("--repeats", type=int, default=20, help="batches of warm cells timed; the median")
    args = parser.parse_args(argv)
    import ray

    cells = [Cell(f"cell {index}", int, (str(index),)) for index in range(args.cpus)]
    started = time.perf_counter()
    executor = RayExecutor(num_cpus=args.cpus)
    executor.start()
    initialised = time.perf_counter()
    run_cells(cells, executor, progress=False)
    first = time.perf_counter()
    warm, local = [], []
    for _ in range(args.repeats):
        for runs, chosen in ((warm, executor), (local, LocalExecutor())):
            start = time.perf_counter()
            run_cells(cells, chosen, progress=False)
            runs.append(time.perf_counter() - start)
    ray.shutdown()
    print(f"ray.init, a local instance of {args.cpus} CPUs: {initialised - started:.1f} s")
    print(f"its first {args.cpus} cells (the workers start): {first - initialised:.1f} s")
    per_cell = (statistics.median(warm) - statistics.median(local)) / len(cells)
    print(
        f"a cell on a warm worker: {per_cell * 1e3:.1f} ms more than here "
        f"({statistics.median(warm) / statistics.median(local):.0f}× a trivial cell run here; median of {args.repeats})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
