"""Merge or compose, decided item by item: confidence sequences by betting, and a rule that stops early.

The best merge and the best composition answer the same test items, one at a time, in a random order; an item
is right or wrong for each. After every item the rule asks whether the items so far already decide the paired
label (`mergecompose.analysis.paired_outcome`), at an error rate `alpha` that holds *whenever* it stops (it may
look after every item: the bounds are anytime-valid, Ville's inequality).

**Confidence sequences** (`BettingConfidenceSequence`): for observations x_1, x_2, … in [0, 1] with mean μ, the
hedged capital process of Waudby-Smith & Ramdas (2024), "Estimating means of bounded random variables by
betting", J. R. Stat. Soc. B 86(1), with their predictable plug-in bets. For each candidate mean m on a grid,

    K⁺_t(m) = Π_{i≤t} (1 + λ⁺_i(m) (x_i − m)),   K⁻_t(m) = Π_{i≤t} (1 − λ⁻_i(m) (x_i − m)),
    K_t(m) = θ K⁺_t(m) + (1 − θ) K⁻_t(m),          θ = 1/2,
    λ̃_i = sqrt(2 log(2/α) / (σ̂²_{i−1} · i · log(1 + i))),   λ⁺_i(m) = min(λ̃_i, c/m),   λ⁻_i(m) = min(λ̃_i, c/(1 − m)),

with μ̂_i = (1/2 + Σ_{j≤i} x_j) / (i + 1), σ̂²_i = (1/4 + Σ_{j≤i} (x_j − μ̂_j)²) / (i + 1) and c = 3/4. Any c < 1
keeps both capitals positive (the authors' package, confseq, defaults to 1/2; 3/4 stops sooner on an accuracy
near 0 or 1), and the paper combines K⁺ and K⁻ by their maximum; their average, used here, is itself a
martingale and never below the maximum. At the true mean, K is a nonnegative martingale started at 1, so
P(∃t: K_t(μ) ≥ 1/α) ≤ α; the confidence sequence is
{m : K_t(m) < 1/α}, intersected over time. It holds for i.i.d. items: the test items are a sample of the task,
and the random order makes the sequence exchangeable whatever order the file has.

**The rule** (`SequentialDecision`), after each item, on three confidence sequences: the merge's accuracy and the
composition's (each at α/4), and the difference of accuracies Δ = acc_compose − acc_merge (at α/2, on
x = (compose_right − merge_right + 1) / 2, whose mean is (Δ + 1) / 2). In order:

1. **"neither"** when the upper bounds of both accuracies are below the floor (10 %);
2. **"compose"** when Δ's lower bound is above 0 and the composition's accuracy lower bound reaches the floor;
   **"merge"** when Δ's upper bound is below 0 and the merge's lower bound reaches the floor;
3. **"either"** when Δ's sequence lies within (−δ, δ) and both accuracies' lower bounds reach the floor;
4. at the item budget (or when the items run out), the label of the fixed-n test on every item used
   (`paired_outcome`, exact McNemar at α and the same floor), marked `budget_reached`.

A stop at steps 1–3 is wrong only where one of the three sequences misses its parameter, so the probability that
the rule ever stops with a wrong label is at most α/4 + α/4 + α/2 = α (a union bound). The label at the budget is a
fixed-n test read after the sequential looks, and is not covered by that bound: results say when it was reached.

Everything is vectorised over a batch of independent sequences (the replays run many orders at once); the grid
bounds are widened by one grid step each side, so that a bound is never tighter than the grid can tell.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from mergecompose.analysis.paired_outcome import ALPHA, FLOOR, paired_outcome

LABELS = ("merge", "compose", "either", "neither")
DELTA = 0.10  # "either": the difference in accuracy is within ±δ
GRID_POINTS = 401  # candidate means on [0, 1]: a step of 0.0025 (0.005 on Δ's scale)


class BettingConfidenceSequence:
    """Anytime-valid bounds on the mean of [0, 1] observations, for `batch` independent sequences at once.

    `update(x)` takes one observation per sequence, shape (batch,); `active` (batch,) bools, if given, says which
    sequences take this one (the others keep their state). `lower` and `upper` are the running bounds, (batch,).
    """

    def __init__(self, alpha: float, batch: int = 1, grid_points: int = GRID_POINTS, c: float = 0.75):
        if not 0 < alpha < 1:
            raise ValueError(f"`alpha` must be in (0, 1), got {alpha!r}")
        if batch < 1 or grid_points < 3:
            raise ValueError(f"`batch` must be ≥ 1 and `grid_points` ≥ 3, got {batch} and {grid_points}")
        if not 0 < c < 1:
            raise ValueError(f"`c` must be in (0, 1), got {c!r}")
        self.alpha, self.c = alpha, c
        self.grid = np.linspace(0.0, 1.0, grid_points)  # (G,)
        self.step = 1.0 / (grid_points - 1)
        self.threshold = math.log(1 / alpha)
        self.items = np.zeros(batch, dtype=np.int64)  # (B,)
        self.total = np.zeros(batch)  # Σ x
        self.squares = np.zeros(batch)  # Σ (x_j − μ̂_j)²
        self.log_plus = np.zeros((batch, grid_points))  # (B, G) log K⁺
        self.log_minus = np.zeros((batch, grid_points))  # (B, G) log K⁻
        self.log_capital = np.zeros((batch, grid_points))  # (B, G) log K_t
        self.alive = np.ones((batch, grid_points), dtype=bool)  # (B, G) not yet rejected (running intersection)
        self.lower_index = np.zeros(batch, dtype=np.int64)  # (B,) the bounds as grid indices: decisions compare
        self.upper_index = np.full(batch, grid_points - 1)  # these integers, never floats at a rounding

    def update(self, x: np.ndarray, active: np.ndarray | None = None) -> None:
        x = np.asarray(x, dtype=float)  # (B,)
        active = np.ones(x.shape, dtype=bool) if active is None else np.asarray(active, dtype=bool)
        if x.shape != self.items.shape or active.shape != self.items.shape:
            raise ValueError(f"`x` and `active` must have shape {self.items.shape}, got {x.shape} and {active.shape}")
        if np.any((x[active] < 0) | (x[active] > 1)):
            raise ValueError(f"observations must be in [0, 1], got {x[active].min()} … {x[active].max()}")
        t = self.items + 1  # (B,) this observation's index, from 1
        variance = (0.25 + self.squares) / t  # σ̂²_{t−1} = (1/4 + Σ_{j<t} (x_j − μ̂_j)²) / t
        bet = np.sqrt(2 * math.log(2 / self.alpha) / (variance * t * np.log1p(t)))  # (B,) λ̃_t
        with np.errstate(divide="ignore"):
            cap_plus = self.c / self.grid  # (G,) c/m (inf at m = 0)
            cap_minus = self.c / (1 - self.grid)  # (G,) c/(1 − m)
        lam_plus = np.minimum(bet[:, None], cap_plus[None, :])  # (B, G)
        lam_minus = np.minimum(bet[:, None], cap_minus[None, :])
        centred = x[:, None] - self.grid[None, :]  # (B, G) x_t − m
        mask = active[:, None]
        self.log_plus += np.where(mask, np.log1p(lam_plus * centred), 0.0)
        self.log_minus += np.where(mask, np.log1p(-lam_minus * centred), 0.0)
        self.log_capital = np.logaddexp(self.log_plus, self.log_minus) + math.log(0.5)  # (B, G) log K_t
        self.alive &= ~mask | (self.log_capital < self.threshold)
        self.items = np.where(active, t, self.items)
        self.total = np.where(active, self.total + x, self.total)
        mean = (0.5 + self.total) / (self.items + 1)  # μ̂_t
        self.squares = np.where(active, self.squares + (x - mean) ** 2, self.squares)
        self._bounds(active)

    def _bounds(self, active: np.ndarray) -> None:
        """The outermost surviving grid points, one step wider; an empty set keeps the bounds it had."""
        some = self.alive.any(axis=1) & active  # (B,)
        last_point = self.alive.shape[1] - 1
        first = np.maximum(np.argmax(self.alive, axis=1) - 1, 0)  # (B,) first surviving index, one step lower
        last = np.minimum(last_point - np.argmax(self.alive[:, ::-1], axis=1) + 1, last_point)
        self.lower_index = np.where(some, np.maximum(self.lower_index, first), self.lower_index)
        self.upper_index = np.where(some, np.minimum(self.upper_index, last), self.upper_index)

    @property
    def lower(self) -> np.ndarray:
        return self.lower_index / (len(self.grid) - 1)  # (B,)

    @property
    def upper(self) -> np.ndarray:
        return self.upper_index / (len(self.grid) - 1)

    def difference_bounds(self, index: int) -> tuple[float, float]:
        """For a sequence of x = (Δ + 1) / 2: Δ's bounds, (2i − (G − 1)) / (G − 1) at the bounds' indices i."""
        points = len(self.grid) - 1
        return (
            float((2 * self.lower_index[index] - points) / points),
            float((2 * self.upper_index[index] - points) / points),
        )

    def index_of(self, value: float) -> float:
        """`value` on the grid's index scale (a grid point's exact index; rounded at 1e-9 of a step, far below the
        step, so that 0.1 · 400 is 40 and not 40.000000000000004)."""
        return round(value / self.step, 9)


@dataclass(frozen=True)
class DecisionSettings:
    """The rule's settings: error rate `alpha`, the "either" margin `delta`, the `floor`, the item budget."""

    alpha: float = ALPHA
    delta: float = DELTA
    floor: float = FLOOR
    max_items: int | None = None  # None: as many as there are

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 0.5:
            raise ValueError(f"`alpha` must be in (0, 0.5), got {self.alpha!r}")
        if not 0 < self.delta < 1:
            raise ValueError(f"`delta` must be in (0, 1), got {self.delta!r}")
        if not 0 <= self.floor < 1:
            raise ValueError(f"`floor` must be in [0, 1), got {self.floor!r}")
        if self.max_items is not None and (isinstance(self.max_items, bool) or self.max_items < 1):
            raise ValueError(f"`max_items` must be at least 1, got {self.max_items!r}")


@dataclass(frozen=True)
class Decision:
    """One sequence's outcome: its label, how many items it used, whether the budget decided it, the bounds."""

    label: str
    items: int
    budget_reached: bool
    merge_right: int
    compose_right: int
    merge_only: int
    compose_only: int
    merge_interval: tuple[float, float]
    compose_interval: tuple[float, float]
    difference_interval: tuple[float, float]  # Δ = acc_compose − acc_merge

    def to_dict(self) -> dict:
        return asdict(self)


class SequentialDecision:
    """The rule of the module docstring, for `batch` sequences at once; feed items with `update` until `done`."""

    def __init__(self, settings: DecisionSettings = DecisionSettings(), batch: int = 1, grid_points: int = GRID_POINTS):
        self.settings = settings
        quarter = settings.alpha / 4
        self.merge = BettingConfidenceSequence(quarter, batch, grid_points)
        self.compose = BettingConfidenceSequence(quarter, batch, grid_points)
        self.difference = BettingConfidenceSequence(settings.alpha / 2, batch, grid_points)
        self.labels: list[str | None] = [None] * batch
        self.counts = np.zeros((batch, 4), dtype=np.int64)  # merge right, compose right, merge only, compose only
        self.budget_reached = np.zeros(batch, dtype=bool)

    @property
    def done(self) -> np.ndarray:
        return np.array([label is not None for label in self.labels])

    def update(self, merge_right: np.ndarray, compose_right: np.ndarray) -> None:
        """One more item for every sequence not yet decided: (batch,) bools each."""
        merge = np.asarray(merge_right, dtype=bool)
        compose = np.asarray(compose_right, dtype=bool)
        active = ~self.done
        self.merge.update(merge.astype(float), active)
        self.compose.update(compose.astype(float), active)
        self.difference.update((compose.astype(float) - merge.astype(float) + 1) / 2, active)
        step = np.stack([merge, compose, merge & ~compose, compose & ~merge], axis=1).astype(np.int64)  # (B, 4)
        self.counts += np.where(active[:, None], step, 0)
        for index, label in zip(np.flatnonzero(active), self._stops()[active]):
            self.labels[index] = label or None

    def _stops(self) -> np.ndarray:
        """Each sequence's label if its bounds decide it now, else "" (the order of the module docstring), on the
        grid's indices: Δ = 0 is the difference grid's middle point, ±δ and the floor their places on it."""
        merge, compose, difference = self.merge, self.compose, self.difference
        floor = merge.index_of(self.settings.floor)
        zero = difference.index_of(0.5)  # x = (Δ + 1) / 2
        band_low = difference.index_of((1 - self.settings.delta) / 2)
        band_high = difference.index_of((1 + self.settings.delta) / 2)
        merge_low, merge_high = merge.lower_index, merge.upper_index  # (B,) each
        compose_low, compose_high = compose.lower_index, compose.upper_index
        low, high = difference.lower_index, difference.upper_index
        return np.select(
            [
                (merge_high < floor) & (compose_high < floor),
                (low > zero) & (compose_low >= floor),
                (high < zero) & (merge_low >= floor),
                (band_low < low) & (high < band_high) & (merge_low >= floor) & (compose_low >= floor),
            ],
            ["neither", "compose", "merge", "either"],
            default="",
        )

    def finish(self, merge_rights: list[list[bool]], compose_rights: list[list[bool]]) -> None:
        """Label every undecided sequence by the fixed-n test on the items it used (the budget, or all there were)."""
        for index, label in enumerate(self.labels):
            if label is None:
                outcome = paired_outcome(
                    merge_rights[index], compose_rights[index], self.settings.alpha, self.settings.floor
                )
                self.labels[index] = outcome.label
                self.budget_reached[index] = True

    def decision(self, index: int = 0) -> Decision:
        if self.labels[index] is None:
            raise ValueError(f"sequence {index} is not decided yet: feed more items, or `finish` it")
        merge_right, compose_right, merge_only, compose_only = (int(v) for v in self.counts[index])
        return Decision(
            label=str(self.labels[index]),
            items=int(self.merge.items[index]),
            budget_reached=bool(self.budget_reached[index]),
            merge_right=merge_right,
            compose_right=compose_right,
            merge_only=merge_only,
            compose_only=compose_only,
            merge_interval=(float(self.merge.lower[index]), float(self.merge.upper[index])),
            compose_interval=(float(self.compose.lower[index]), float(self.compose.upper[index])),
            difference_interval=self.difference.difference_bounds(index),
        )


def decide_sequence(
    merge_right: list[bool], compose_right: list[bool], settings: DecisionSettings = DecisionSettings()
) -> Decision:
    """The rule on one paired sequence, in the order given: it stops at the first decision, else at the budget."""
    if len(merge_right) != len(compose_right) or not merge_right:
        raise ValueError(
            f"`merge_right` and `compose_right` must score the same items, at least one, got {len(merge_right)} "
            f"and {len(compose_right)}"
        )
    budget = min(len(merge_right), settings.max_items or len(merge_right))
    rule = SequentialDecision(settings)
    for item in range(budget):
        rule.update(np.array([merge_right[item]]), np.array([compose_right[item]]))
        if rule.done[0]:
            break
    used = int(rule.merge.items[0])
    rule.finish([list(merge_right[:used])], [list(compose_right[:used])])
    return rule.decision(0)


def replay_orders(
    merge_right: list[bool],
    compose_right: list[bool],
    orders: int,
    seed: int,
    settings: DecisionSettings = DecisionSettings(),
) -> list[Decision]:
    """The rule over `orders` random orders of one setting's paired items (numpy's PCG64 from `seed`), at once."""
    merge, compose = np.asarray(merge_right, dtype=bool), np.asarray(compose_right, dtype=bool)
    if merge.shape != compose.shape or merge.ndim != 1 or merge.size == 0:
        raise ValueError(
            f"`merge_right` and `compose_right` must score the same items, got {merge.shape}, {compose.shape}"
        )
    rng = np.random.default_rng(seed)
    permutations = np.stack([rng.permutation(merge.size) for _ in range(orders)])  # (R, n)
    budget = min(merge.size, settings.max_items or merge.size)
    rule = SequentialDecision(settings, batch=orders)
    for item in range(budget):
        rule.update(merge[permutations[:, item]], compose[permutations[:, item]])
        if rule.done.all():
            break
    used = rule.merge.items
    rule.finish(
        [merge[permutations[r, : used[r]]].tolist() for r in range(orders)],
        [compose[permutations[r, : used[r]]].tolist() for r in range(orders)],
    )
    return [rule.decision(r) for r in range(orders)]
