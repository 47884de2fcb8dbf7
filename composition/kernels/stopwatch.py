"""Speed choices made by measuring on the machine at hand, never fixed by CPU family.

Which kernel is faster for a linear over few rows, whether oneDNN's packed weights beat dense ones, whether mixing
the components' hidden states before the output layer beats one output-layer pass per component: each answer
depends on the CPU, its vector units and its BLAS (benchmarks/README.md has one CPU where packing pays and another
where it costs). So each choice times its options on the machine, at load or on the first passes, through a
`Stopwatch`; a test gives a fake one that prefers an option and sees that option chosen.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


class Stopwatch:
    """Times one run of an option: `measure(option, run)` gives run's result and the seconds it took.

    `option` names what is being timed; the clock ignores it, a fake stopwatch in a test reads it."""

    def measure(self, option: str, run: Callable[[], T]) -> tuple[T, float]:
        start = time.perf_counter()
        result = run()
        return result, time.perf_counter() - start


@dataclass
class Choice:
    """What a measurement chose, and every option's timed runs (seconds) that it chose from."""

    chosen: str
    seconds: dict[str, list[float]] = field(default_factory=dict)

    def summary(self) -> dict[str, object]:
        """The choice and each option's best time in milliseconds, for a report."""
        best = {option: round(min(times) * 1e3, 3) for option, times in self.seconds.items() if times}
        return {"chosen": self.chosen, "best_ms": best}


def timed_runs(
    options: Mapping[str, Callable[[], object]], stopwatch: Stopwatch, repeats: int
) -> dict[str, list[float]]:
    """Each option's seconds in `repeats` rounds, after one untimed warm-up run of each; in a round each option runs
    once, in turn (interleaved: a round's noise falls on every option alike)."""
    if not options or repeats < 1:
        raise ValueError(f"timing needs options and repeats >= 1, got {len(options)} options, repeats={repeats}")
    for run in options.values():
        run()
    seconds: dict[str, list[float]] = {option: [] for option in options}
    for _ in range(repeats):
        for option, run in options.items():
            seconds[option].append(stopwatch.measure(option, run)[1])
    return seconds


def best(seconds: dict[str, list[float]]) -> Choice:
    """The option with the smallest best time (a slow first run, a warm-up, does not count against it); ties go to
    the option listed first."""
    return Choice(min(seconds, key=lambda option: min(seconds[option])), seconds)


def fastest(options: Mapping[str, Callable[[], object]], stopwatch: Stopwatch, repeats: int = 5) -> Choice:
    """The option with the smallest best time in `timed_runs`."""
    return best(timed_runs(options, stopwatch, repeats))
