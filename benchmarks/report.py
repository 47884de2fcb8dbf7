"""What every benchmark does last: say under what conditions it ran, and write its results as JSON."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from mergecompose.core.io import markdown_table


def conditions(repeats: int) -> dict:
    """The commit of the checkout, the CPU's vector capability (torch's `get_cpu_capability()`: AVX2, AVX512, ...),
    the 1-minute load average now and the number of interleaved repeats.

    Call it at the start and at the end of a run: a figure taken while the load average is well above 0
    shared the machine with other work."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
        commit += "+changes" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "commit": commit,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "interleaved_repeats": repeats,
    }


def conditions_line(start: dict, end: dict) -> str:
    return (
        f"commit {start['commit']}, CPU {start['cpu_capability']}, load average {start['load_average_1min']} at the "
        f"start and {end['load_average_1min']} at the end, median of {start['interleaved_repeats']} interleaved repeats"
    )


def write_results(results: dict, out: str | Path) -> None:
    """Write `results` to `out` (parents created) as indented JSON, and say where."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


def profile_table(run, label: str, rows: int) -> list[dict]:
    """`run()` under torch.profiler: its `rows` most expensive operators by self CPU time, printed under `label`
    with the total, and returned as [{"operator", "calls", "self_cpu_ms"}, ...]."""
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        run()
    events = sorted(profiler.key_averages(), key=lambda event: -event.self_cpu_time_total)
    total = sum(event.self_cpu_time_total for event in events)
    table = [
        {"operator": event.key, "calls": event.count, "self_cpu_ms": event.self_cpu_time_total / 1e3}
        for event in events[:rows]
    ]
    print(f"profile of {label}: self CPU {total / 1e3:.0f} ms in all")
    lines = [[row["operator"], row["calls"], f"{row['self_cpu_ms']:.1f}"] for row in table]
    print(markdown_table(["operator", "calls", "self CPU ms"], lines, pad=True))
    return table
