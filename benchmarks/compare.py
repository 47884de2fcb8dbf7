"""Wall time of `mergecompose compare` from nothing and from cached checkpoints.

Runs the command twice in a fresh run folder, each in its own process: the first trains every
checkpoint, the second finds them cached (same resolved config) and only evaluates.

    python -m benchmarks.compare                      # configs/letters.yaml, the README's main job
    python -m benchmarks.compare --config FILE.yaml   # any compare config
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.report import write_results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/letters.yaml")
    parser.add_argument("--out", default="benchmarks/results/compare.json")
    return parser


def timed_compare(config: str, run_dir: Path) -> float:
    command = [sys.executable, "-m", "mergecompose.cli", "compare", config, "--out", str(run_dir), "--quiet"]
    start = time.perf_counter()
    finished = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if finished.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed:\n{finished.stderr[-3000:]}")
    return seconds


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        run_dir = Path(folder) / "run"
        results = {
            "config": args.config,
            "from_nothing_seconds": timed_compare(args.config, run_dir),
            "cached_seconds": timed_compare(args.config, run_dir),
        }
    print(f"mergecompose compare {args.config}")
    print(f"{'run':<14} {'wall s':>8}")
    print(f"{'from nothing':<14} {results['from_nothing_seconds']:>8.1f}")
    print(f"{'cached':<14} {results['cached_seconds']:>8.1f}")
    write_results(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
