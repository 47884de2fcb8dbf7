"""Bounded summaries of a stream that the reducers share, and the labels the report uses.

`LogHistogram` counts values in log-spaced bins (its quantiles bound the true ones from above);
`PositionReservoir` keeps a uniform sample of positions. Both hold O(bins) or O(size) state,
however many positions pass.
"""

from __future__ import annotations

import math

import torch


class LogHistogram:
    """Counts of non-negative values in log-spaced bins.

    Bin 0 holds `[0, low)` (exact zeros included), bins 1…n the log-spaced intervals
    `[e_{i−1}, e_i)` between `low` and `high`, and the last bin `[high, ∞]`.
    """

    def __init__(self, low: float = 1e-8, high: float = 1e2, bins_per_decade: int = 10):
        if not 0 < low < high:
            raise ValueError(f"need 0 < `low` < `high`, got low={low}, high={high}")
        decades = math.log10(high / low)
        self.edges = torch.logspace(
            math.log10(low), math.log10(high), round(decades * bins_per_decade) + 1, dtype=torch.float64
        )
        self.counts = torch.zeros(len(self.edges) + 1, dtype=torch.int64)

    def add(self, values: torch.Tensor) -> None:
        index = torch.bucketize(values.detach().double().flatten().cpu(), self.edges, right=True)
        self.counts += torch.bincount(index, minlength=len(self.counts))

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def quantile(self, fraction: float) -> float | None:
        """An upper bound on the `fraction` quantile: the upper edge of the bin that reaches it; None when empty."""
        if self.total == 0:
            return None
        cumulative = self.counts.cumsum(0).double() / self.total
        index = int(torch.searchsorted(cumulative, torch.tensor([fraction], dtype=torch.float64))[0])
        uppers = torch.cat([self.edges, torch.tensor([float("inf")], dtype=torch.float64)])
        return float(uppers[min(index, len(uppers) - 1)])

    def to_dict(self) -> dict:
        """`counts[0]` is `[0, edges[0])`, `counts[i]` is `[edges[i-1], edges[i])`, `counts[-1]` is `[edges[-1], ∞]`."""
        return {"edges": self.edges.tolist(), "counts": self.counts.tolist()}


class PositionReservoir:
    """Uniform sample of `size` positions from a stream (Vitter's Algorithm R), seeded.

    Item s of the stream (0-based) fills slot s while s < size; after that it replaces a
    uniformly drawn slot with probability size/(s+1). Every item ends up kept with equal
    probability size/n.
    """

    def __init__(self, size: int, seed: int = 0):
        self.size = size
        self.seen = 0
        self.items: list[dict | None] = [None] * size
        self.generator = torch.Generator().manual_seed(seed)

    def select(self, n: int) -> list[tuple[int, int]]:
        """Offer the next n items; return `(slot, index within these n)` to store, in order."""
        if self.size == 0 or n == 0:
            self.seen += n
            return []
        stream_index = torch.arange(self.seen, self.seen + n, dtype=torch.float64)
        draws = torch.floor(torch.rand(n, generator=self.generator, dtype=torch.float64) * (stream_index + 1)).long()
        slots = torch.where(stream_index < self.size, stream_index.long(), draws)
        self.seen += n
        keep = (slots < self.size).nonzero().flatten().tolist()
        return [(int(slots[i]), i) for i in keep]

    def store(self, slot: int, item: dict) -> None:
        self.items[slot] = item

    def samples(self) -> list[dict]:
        return [item for item in self.items if item is not None]


def pair_key(name_a: str, name_b: str) -> str:
    return f"{name_a}|{name_b}"


def token_labels(ids: list[int], decode=None) -> list:
    """Token strings where `decode` is known and gives text ("#id" where the text is empty), else the ids."""
    if decode is None:
        return ids
    return [decode([token]) or f"#{token}" for token in ids]
