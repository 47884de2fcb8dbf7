"""Streaming reduction of the diagnostics: chunks of positions in, scalars and histograms out.

`OverlapAccumulator.update` takes the component log-probs of one batch, computes what every
measure needs once (`mergecompose.analysis.measured_batch.MeasuredBatch`, a few positions at a time,
so that each pass over the vocabulary works in cache) and hands it to a list of small reducers
(`mergecompose.analysis.reducers.Reducer`), each with its own running sums, `update` and `report`.
The batch is then dropped. Memory is O(k·V + k² + bins + reservoir), independent of the number of
tokens: no `(N, V)` tensor for the whole data set is ever kept. `report` joins the reducers' parts
(`merge_reports`) into an `OverlapReport`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from mergecompose.analysis.diagnostics import active_intervals
from mergecompose.analysis.measured_batch import MeasuredBatch, SequenceBatch
from mergecompose.analysis.overlap_settings import OverlapSettings
from mergecompose.analysis.reducers import (
    ActivityReducer,
    KLHistogramReducer,
    LinearizationReducer,
    MergeGapReducer,
    PairOverlapReducer,
    ProjectiveErrorReducer,
    Reducer,
    Top1ShiftReducer,
    TopTokenReducer,
    VocabularyReducer,
    merge_reports,
)
from mergecompose.analysis.retention_reducer import RetentionReducer
from mergecompose.analysis.sequence_reducers import ExampleReducer, IntervalReducer
from mergecompose.analysis.summaries import PositionReservoir
from mergecompose.composition.rule import check_weights, compose_logprobs


@dataclass
class OverlapReport:
    """What `OverlapAccumulator.report()` returns; `to_dict()` is the content of overlap.json.

    * `coactivation_rate`: `P(|A_t(ε)| ≥ 2)` at `settings.epsilon`, and per ε in
      `coactivation_by_epsilon`;
    * `experts[name]`: `kl_mean` (mean `KL(p_i ‖ p_b)`), `active_fraction`, `top1_shift_rate` (share of
      positions where its top-1 token differs from the base's), interval statistics,
      `projective_error` (mean restricted KL), the tokens it moves most, the KL histogram;
    * `pairs["a|b"]`: `mass_overlap` (O_ij pooled over all positions and tokens),
      `sign_conflict` (conflicting share of that overlap), `support_jaccard`, `delta_norm_ratio`
      (larger over smaller weighted RMS delta norm), `top1_both_shift_rate` and `top1_same_shift_share`
      (share of positions both shift the base's top-1 token; of those, share shifted to the same token),
      co-activation and interval overlap of the two, `parameter` (task-vector measures, when known);
    * `projective_error`: `single_active` (mean `KL(p_active ‖ q)` over steps with `|A_t| ≤ 1`),
      `dominant_shift` (mean `KL(p_o ‖ q)` over steps where exactly one expert o shifts the base's
      top-1 token; defined where every step is co-active) and `per_expert`;
    * `merge_compose_gap`: `kl_mean` of `KL(q ‖ m)`, `top1_agreement`, the interaction residual,
      the histogram (present when a merged model was measured);
    * `reservoir`: example positions with the top tokens of every component;
    * `vocabulary` (on the top-k union, the default): the mass each distribution puts outside
      the measured tokens, mean and largest over positions; then every pair also has
      `mass_overlap_bounds`, an interval that holds its mass overlap over all V;
    * `retention` (`mergecompose.analysis.retention`): where each expert shifts the base's top-1 token, how far
      the merge and the composition are from it and how often they keep its token (per expert under
      `experts[name]["retention"]`, with the base's mean log-probability of the expert's top-1 token), the skill
      most lost in each, and merge minus composition.
    """

    num_positions: int
    num_sequences: int
    settings: dict
    coactivation_rate: float
    coactivation_by_epsilon: dict[str, float]
    active_count_distribution: list[float]
    experts: dict[str, dict]
    pairs: dict[str, dict]
    projective_error: dict
    merge_compose_gap: dict | None
    heatmap: list[dict]
    reservoir: list[dict]
    vocabulary: dict | None = None
    retention: dict | None = None
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        """`to_dict()` without the bulky parts (examples, heatmap, histograms); top tokens cut to 5."""
        result = self.to_dict()
        for key in ("heatmap", "reservoir"):
            result.pop(key)
        for stats in result["experts"].values():
            stats.pop("kl_histogram")
            stats["top_tokens"] = stats["top_tokens"][:5]
        if "merge_compose_gap" in result:
            result["merge_compose_gap"].pop("histogram")
        return result

    def to_dict(self) -> dict:
        result = asdict(self)
        extra = result.pop("extra")
        for key in ("merge_compose_gap", "vocabulary", "retention"):
            if result[key] is None:
                del result[key]
        result.update(extra)
        return result


def _pick(tensor: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    """`(*lead, B, T, V)` -> `(*lead, n, V)` at the flat positions `rows` (ascending); a view where they are
    contiguous."""
    if tensor is None:
        return None
    flat = tensor.flatten(-3, -2)  # (*lead, B·T, V)
    first, count = int(rows[0]), len(rows)
    if int(rows[-1]) - first + 1 == count:
        return flat.narrow(-2, first, count)
    return flat.index_select(-2, rows)


class OverlapAccumulator:
    """Running reduction of the overlap diagnostics over batches of positions.

    A thin composite over `reducers`, a list of `Reducer`s: `update` checks the batch, computes the
    shared `MeasuredBatch` (chunk by chunk) and `SequenceBatch` once and passes each to the reducers
    that read it; `report` joins their parts with `merge_reports` into an `OverlapReport`.

    Args:
        expert_names: the k experts, in the order of the component tensors after the base.
        vocab_size: V.
        weights: the composition exponents `w_i` (also the λ of the merge being compared);
            default 1.0 each.
        settings: thresholds and sizes (`OverlapSettings`).
        decode: optional `token ids -> str`, used for the report's token lists and examples.
        chunk_positions: positions handed to the reducers at a time (default: all of a batch on
            the top-k union, about 2^21 values per `(positions, V)` tensor on the full vocabulary);
            the report does not depend on it.
    """

    def __init__(
        self,
        expert_names: Sequence[str],
        vocab_size: int,
        weights: Sequence[float] | None = None,
        settings: OverlapSettings | None = None,
        decode: Callable[[list[int]], str] | None = None,
        chunk_positions: int | None = None,
    ):
        if len(expert_names) == 0:
            raise ValueError("`expert_names` must name at least one expert, got none")
        if len(set(expert_names)) != len(expert_names):
            raise ValueError(f"`expert_names` must be unique, got {list(expert_names)}")
        self.names = list(expert_names)
        self.k = len(self.names)
        self.vocab_size = int(vocab_size)
        self.weights = check_weights(weights, self.k) or [1.0] * self.k
        self.settings = settings or OverlapSettings()
        self.decode = decode
        if chunk_positions is not None and not (isinstance(chunk_positions, int) and chunk_positions >= 1):
            raise ValueError(f"`chunk_positions` must be an int >= 1 or None, got {chunk_positions!r}")
        self.chunk_positions = chunk_positions
        self.positions = 0
        self.sequences = 0
        self.examples = ExampleReducer(self.names, self.settings, decode)
        # In the order their keys take in the report, within each expert's and each pair's statistics.
        self.reducers: list[Reducer] = [
            ActivityReducer(self.names, self.settings),
            PairOverlapReducer(self.names),
            Top1ShiftReducer(self.names),
            IntervalReducer(self.names),
            ProjectiveErrorReducer(self.names),
            TopTokenReducer(self.names, self.vocab_size, self.settings.top_tokens, decode),
            KLHistogramReducer(self.names),
            LinearizationReducer(self.names, self.weights),
            MergeGapReducer(self.weights, self.vocab_size),
            VocabularyReducer(self.names, self.settings.candidates),
            RetentionReducer(self.names),
            self.examples,
        ]
        self.position_reducers = [reducer for reducer in self.reducers if reducer.reads is MeasuredBatch]
        self.sequence_reducers = [reducer for reducer in self.reducers if reducer.reads is SequenceBatch]

    @property
    def heatmap(self) -> list[dict]:
        return self.examples.heatmap

    @property
    def reservoir(self) -> PositionReservoir:
        return self.examples.reservoir

    @torch.no_grad()
    def update(
        self,
        components: torch.Tensor,
        mask: torch.Tensor,
        composed: torch.Tensor | None = None,
        merged: torch.Tensor | None = None,
        scaled_experts: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> None:
        """Add one batch.

        Args:
            components: `(k+1, B, T, V)` log-probs, base first (`ComposedLM.component_logprobs`).
            mask: `(B, T)` bool, the positions to measure (padding and unmeasured positions 0).
            composed: `(B, T, V)` composed log-probs; computed with `compose_logprobs` and
                `weights` when omitted.
            merged: `(B, T, V)` log-probs of the merge `θ_b + λΣτ_i`, optional.
            scaled_experts: `(k, B, T, V)` log-probs of `θ_b + λτ_i` per expert, optional. When
                every weight is 1 these are the experts themselves and need not be given.
            input_ids: `(B, T)`, optional; used to label example positions.
            attention_mask: `(B, T)`, optional; padding is left out of the examples' context.
        """
        k, V = self.k, self.vocab_size
        if components.dim() != 4 or components.shape[0] != k + 1 or components.shape[-1] != V:
            raise ValueError(
                f"`components` must be (k+1, batch, seq, V) = ({k + 1}, B, T, {V}), got {tuple(components.shape)}"
            )
        batch_shape = tuple(components.shape[1:3])
        if tuple(mask.shape) != batch_shape:
            raise ValueError(f"`mask` must be (batch, seq) = {batch_shape}, got {tuple(mask.shape)}")
        for name, tensor, lead in [
            ("composed", composed, ()),
            ("merged", merged, ()),
            ("scaled_experts", scaled_experts, (k,)),
        ]:
            if tensor is not None and tuple(tensor.shape) != (*lead, *batch_shape, V):
                raise ValueError(f"`{name}` must have shape {(*lead, *batch_shape, V)}, got {tuple(tensor.shape)}")

        mask = mask.bool().to(components.device)
        if composed is None:
            composed = compose_logprobs(components[0], list(components[1:]), self.weights)  # (B, T, V)
        if scaled_experts is None and merged is not None and all(w == 1.0 for w in self.weights):
            scaled_experts = components[1:]  # θ_b + 1·τ_i = θ_i
        n = int(mask.sum())
        if n == 0:
            return
        # The measured positions, row-major, as indices into the flattened (B·T) axis: no copy of the batch.
        flat = mask.flatten().nonzero().flatten()  # (N,)
        B, T = batch_shape
        step = self.chunk_positions or (n if not self.settings.full_vocabulary else max(1, 2**21 // V))
        activity = []
        for start in range(0, n, step):
            rows = flat[start : start + step]
            measured = MeasuredBatch.measure(
                _pick(components, rows),
                _pick(composed, rows),
                _pick(merged, rows),
                _pick(scaled_experts, rows),
                self.weights,
                self.settings,
            )
            for reducer in self.position_reducers:
                reducer.update(measured)
            activity.append(measured.activity)
        activity_grid = torch.zeros(k, B, T, device=components.device)  # (k, B, T)
        activity_grid[:, mask] = torch.cat(activity, dim=1)
        sequences = SequenceBatch(
            mask=mask,
            activity_grid=activity_grid,
            intervals=active_intervals(activity_grid, self.settings.epsilon, mask),
            components=components,
            composed_grid=composed,
            merged_grid=merged,
            input_ids=input_ids,
            attention_mask=attention_mask,
        )
        for reducer in self.sequence_reducers:
            reducer.update(sequences)
        self.positions += n
        self.sequences += int(mask.any(-1).sum())

    def report(self) -> OverlapReport:
        """Join the reducers' parts into an `OverlapReport`; an error if no position was measured."""
        if self.positions == 0:
            raise ValueError(
                "nothing to report: every `mask` given to `update` was all zero (0 positions measured); "
                "its rates and means would be undefined"
            )
        own = {"num_positions": self.positions, "num_sequences": self.sequences, "settings": self.settings.model_dump()}
        parts = [(type(self).__name__, own), *((type(reducer).__name__, reducer.report()) for reducer in self.reducers)]
        return OverlapReport(**merge_reports(parts))
