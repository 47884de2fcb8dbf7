"""The reducers of whole sequences: active intervals, and the examples the report shows.

Each reads a `SequenceBatch` (a batch of sequences as given, with every measured position's
activity in place) and follows `mergecompose.analysis.reducers.Reducer`.
"""

from __future__ import annotations

import torch

from mergecompose.analysis import diagnostics as dx
from mergecompose.analysis.measured_batch import SequenceBatch
from mergecompose.analysis.overlap_settings import OverlapSettings
from mergecompose.analysis.summaries import PositionReservoir, pair_key, token_labels


class IntervalReducer:
    """Active intervals `[τ1, τ2)` per sequence: how often and how long each expert is active,
    and per pair how often the two intervals intersect and their mean IoU."""

    reads = SequenceBatch

    def __init__(self, names: list[str]):
        k = len(names)
        self.names = names
        self.pairs = [(i, j) for i in range(k) for j in range(i + 1, k)]
        self.sequences = 0
        self.sequences_active = torch.zeros(k, dtype=torch.int64)
        self.interval_length_sum = torch.zeros(k, dtype=torch.float64)
        self.pair_both_active = torch.zeros(k, k, dtype=torch.int64)
        self.pair_intersecting = torch.zeros(k, k, dtype=torch.int64)
        self.pair_iou_sum = torch.zeros(k, k, dtype=torch.float64)

    def update(self, batch: SequenceBatch) -> None:
        self.sequences += int(batch.mask.any(-1).sum())
        intervals = batch.intervals  # (k, B, 2)
        active = intervals[..., 0] >= 0  # (k, B)
        lengths = (intervals[..., 1] - intervals[..., 0]).clamp(min=0)  # (k, B)
        self.sequences_active += active.sum(1).cpu()
        self.interval_length_sum += lengths.double().sum(1).cpu()
        intersections = dx.interval_intersections(intervals)  # (k, k, B)
        both = active[:, None] & active[None]  # (k, k, B)
        union = lengths[:, None] + lengths[None] - intersections
        iou = torch.where(both, intersections / union.clamp(min=1), torch.zeros(()))
        self.pair_both_active += both.sum(-1).cpu()
        self.pair_intersecting += (intersections > 0).sum(-1).cpu()
        self.pair_iou_sum += iou.double().sum(-1).cpu()

    def report(self) -> dict:
        """`{"experts": {name: stats}, "pairs": {"a|b": stats}}`."""
        sequences = max(self.sequences, 1)
        experts = {
            name: {
                "sequences_active_fraction": float(self.sequences_active[index]) / sequences,
                "interval_length_mean": float(self.interval_length_sum[index])
                / max(int(self.sequences_active[index]), 1),
            }
            for index, name in enumerate(self.names)
        }
        pairs = {}
        for i, j in self.pairs:
            both = int(self.pair_both_active[i, j])
            pairs[pair_key(self.names[i], self.names[j])] = {
                "interval_overlap_rate": float(self.pair_intersecting[i, j]) / both if both else None,
                "interval_iou_mean": float(self.pair_iou_sum[i, j]) / both if both else None,
            }
        return {"experts": experts, "pairs": pairs}


class ExampleReducer:
    """Examples for the report: the per-position activity and intervals of the first
    `heatmap_sequences` sequences, and a uniform reservoir of positions with every component's top tokens."""

    reads = SequenceBatch

    def __init__(self, names: list[str], settings: OverlapSettings, decode=None):
        self.names = names
        self.heatmap_sequences = settings.heatmap_sequences
        self.top_k = settings.top_k
        self.decode = decode
        self.sequences = 0
        self.heatmap: list[dict] = []
        self.reservoir = PositionReservoir(settings.reservoir_size, settings.seed)

    def update(self, batch: SequenceBatch) -> None:
        rows = batch.mask.any(-1).nonzero().flatten().tolist()
        first_sequence = self.sequences
        self.sequences += len(rows)
        self._update_heatmap(batch, rows, first_sequence)
        self._update_reservoir(batch, rows, first_sequence)

    def _update_heatmap(self, batch: SequenceBatch, rows: list[int], first_sequence: int) -> None:
        mask, input_ids = batch.mask, batch.input_ids
        for offset, row in enumerate(rows):
            if len(self.heatmap) >= self.heatmap_sequences:
                break
            columns = mask[row].nonzero().flatten()
            # Each expert's [τ1, τ2) as indices into this row's measured positions; None if never active.
            measured_index = mask[row].long().cumsum(0) - 1
            row_intervals = [
                None if start < 0 else [int(measured_index[start]), int(measured_index[end - 1]) + 1]
                for start, end in batch.intervals[:, row].tolist()
            ]
            # Position t predicts token t+1: label each column with the token it predicts.
            next_tokens = None
            if input_ids is not None:
                padded = torch.cat([input_ids[row], input_ids.new_full((1,), -1)])
                next_tokens = [
                    None if t < 0 else token_labels([t], self.decode)[0] for t in padded[columns + 1].tolist()
                ]
            self.heatmap.append(
                {
                    "sequence": first_sequence + offset,
                    "activity": batch.activity_grid[:, row, columns].cpu().tolist(),  # (k, n_row)
                    "next_tokens": next_tokens,
                    "intervals": row_intervals,
                }
            )

    def _update_reservoir(self, batch: SequenceBatch, rows: list[int], first_sequence: int) -> None:
        input_ids, attention_mask = batch.input_ids, batch.attention_mask
        named = [
            ("base", batch.components[0]),
            *zip(self.names, batch.components[1:]),
            ("composed", batch.composed_grid),
        ]
        if batch.merged_grid is not None:
            named.append(("merged", batch.merged_grid))
        flat = batch.mask.nonzero()  # (N, 2): (row, column)
        for slot, index in self.reservoir.select(flat.shape[0]):
            row, column = flat[index].tolist()
            entry = {
                "sequence": first_sequence + rows.index(row),
                "column": column,
                "position": column if attention_mask is None else int(attention_mask[row, :column].sum()),
                "activity": batch.activity_grid[:, row, column].cpu().tolist(),
            }
            if input_ids is not None:
                start = max(0, column - 15)
                context = input_ids[row, start : column + 1]
                if attention_mask is not None:
                    context = context[attention_mask[row, start : column + 1].bool()]
                entry["context"] = token_labels(context.tolist(), self.decode)
                if column + 1 < input_ids.shape[1]:
                    entry["next_token"] = token_labels([int(input_ids[row, column + 1])], self.decode)[0]
            entry["top"] = {name: self._top(tensor[row, column]) for name, tensor in named}
            self.reservoir.store(slot, entry)

    def _top(self, logprobs: torch.Tensor) -> list[list]:
        values, ids = logprobs.float().topk(min(self.top_k, logprobs.shape[-1]))
        labels = token_labels(ids.tolist(), self.decode)
        return [[label, round(value, 4)] for label, value in zip(labels, values.tolist())]

    def report(self) -> dict:
        """`{"heatmap": [sequence, …], "reservoir": [position, …]}`."""
        return {"heatmap": self.heatmap, "reservoir": self.reservoir.samples()}
