"""Exact speculative decoding of the composed distribution: the loop (Leviathan et al., 2023; Chen et al., 2023).

Each round, a draft model proposes K tokens, one forward pass each; the k+1 components score all
K+1 positions in one forward pass each; the acceptance rule (speculative/acceptance.py) keeps the output exactly
that of decoding without a draft. The drafts themselves are built in speculative/drafts.py.

Batches: each row accepts its own number of tokens. The caches are cut back to the longest
acceptance of the batch (`DynamicCache.crop`); a row that accepted fewer keeps its rejected columns
as masked holes (attention mask 0), so its tokens and their positions are exactly those of plain
decoding. At batch 1 there are no holes. A sliding window counts columns, not tokens; for such
models every row advances by the batch's shortest acceptance instead, which is exact too.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from mergecompose.composition.architecture import bias_dtype, has_sliding_window
from mergecompose.composition.backend import Backend, Caches
from mergecompose.composition.decoding_config import DecodingConfig
from mergecompose.composition.inputs import Prompt
from mergecompose.composition.kernels.few_row_kernel import FewRowKernel
from mergecompose.composition.sampling import NAN_COMPOSITION, NO_STREAM, Compose, Sampler, TokenStream
from mergecompose.composition.separate_models import SeparateModels
from mergecompose.composition.speculative.acceptance import greedy_accepted, outcome_probabilities, round_tokens
from mergecompose.composition.speculative.draft_length import DraftLength
from mergecompose.composition.stops import StopCriteria, Stopping


@dataclass
class SpeculationStats:
    """What one speculative `generate` call did, summed over the rows still generating.

    Attributes:
        num_draft_tokens: K asked for (a round drafts fewer where fewer tokens remain).
        rounds: verification steps (one forward pass of every component each).
        row_rounds: rounds summed over the rows that took part in them.
        draft_passes: forward passes of the draft.
        drafted: drafted tokens; tested: acceptance tests (every accepted draft and each round's
            first rejection); accepted: accepted drafts.
        emitted: tokens emitted (accepted drafts and one residual or bonus token a round, up to EOS
            and `max_new_tokens`).
        plain_rounds: rounds that drafted nothing (K = 0, a plain decoding step), chosen by the adaptive K.
    """

    num_draft_tokens: int
    rounds: int = 0
    row_rounds: int = 0
    draft_passes: int = 0
    drafted: int = 0
    tested: int = 0
    accepted: int = 0
    emitted: int = 0
    plain_rounds: int = 0

    @property
    def acceptance_rate(self) -> float:
        """a = accepted / tested, the per-token acceptance rate of Leviathan et al.'s analysis (NaN before any test).

        With a, a round of K drafts emits E = (1 − a^(K+1)) / (1 − a) tokens on average."""
        return self.accepted / self.tested if self.tested else math.nan

    @property
    def tokens_per_round(self) -> float:
        """Tokens a row emitted per round, on average (E in the formula above)."""
        return self.emitted / self.row_rounds if self.row_rounds else math.nan

    def as_dict(self) -> dict[str, float]:
        return {**vars(self), "acceptance_rate": self.acceptance_rate, "tokens_per_round": self.tokens_per_round}


def attention_bias(mask: torch.Tensor, first: int, dtype: torch.dtype) -> torch.Tensor:
    """The 4D additive attention mask of a pass over columns `first…C−1` of `mask` `(B, C)`: `(B, 1, C − first, C)`.

    0 where the query may attend the key (the key is a token, mask 1, and not after the query), the
    dtype's minimum elsewhere, as eager and SDPA attention add it. transformers takes a 4D mask as
    given; for several query tokens that skips building one, which costs more than the pass saves."""
    columns = mask.shape[1]
    keys = torch.arange(columns, device=mask.device)
    queries = torch.arange(first, columns, device=mask.device)
    allowed = (keys <= queries.unsqueeze(1)) & mask.bool().unsqueeze(1)  # (B, q, C)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)  # (B, 1, q, C)


@torch.no_grad()
def speculative_decode(
    target: Backend,
    draft: Backend,
    compose: Compose,
    prompt: Prompt,
    stopping: Stopping,
    sampler: Sampler,
    num_draft_tokens: int,
    adaptive: bool = True,
    stream: TokenStream = NO_STREAM,
) -> tuple[torch.Tensor, SpeculationStats, torch.Tensor]:
    """Decode with a draft; returns (sequences `(B, P + n)`, statistics, a greedy-NaN flag on the device).

    Args:
        target: the composition's backend, k+1 components.
        draft: the draft model behind the same interface (one component).
        compose: `(k+1, B, T, V)` logits -> `(B, T, V)` composed scores (the remedies applied).
        prompt: the left-padded prompt and the positions of the `max_new_tokens` tokens to generate.
        stopping: as in `ComposedLM.generate`: a row that emits EOS or completes a stop string is
            finished, and the pad id fills its later positions.
        sampler: greedy, or the warpers applied to the target and to the draft alike before the test.
        num_draft_tokens: K, the tokens drafted a round (fewer where fewer are left to generate); with
            `adaptive`, the most a round drafts, each round's K chosen by `DraftLength` (speculative/draft_length.py),
            0 being a plain decoding step.
        stream: where a streamer is given (one row), each round's emitted tokens are put to it.
    """
    state = _Speculation(target, draft, compose, prompt, stopping, sampler, num_draft_tokens)
    lengths = DraftLength(num_draft_tokens, adaptive, draft_cost=_parameters(draft) / _parameters(target))
    remaining = prompt.max_new_tokens  # the most tokens a row still generating may emit
    shown = 0  # the tokens put to the stream
    while True:
        count = min(lengths.next(), remaining - 1)
        start = state.columns.used  # the round's first draft column
        unseen = start - state.draft.cached  # columns the draft has to catch up with before drafting
        trials_before = FewRowKernel.trial_passes
        tested, accepted_before, began = state.stats.tested, state.stats.accepted, time.perf_counter()
        if count == 0:
            remaining = state.plain_step()  # reads from the device: the round is done
        else:
            draft_probabilities = state.propose(count)
            accepted, next_tokens = state.verify(start, draft_probabilities)
            outcome = state.emit(start, accepted, next_tokens)  # reads from the device: the round is done
            remaining = outcome.remaining
        seconds = time.perf_counter() - began
        if stream.streamer is not None:  # one row: the tokens this round emitted
            stream.put(state.output[0, state.prompt_length + shown : state.prompt_length + int(state.emitted[0])])
            shown = int(state.emitted[0])
        # Not timed: a round whose draft caught up with many tokens, or with a pass that tried a few-row kernel
        # (few_row_kernel.py; a trial of the slower kernel can cost several plain passes and would set t_d for long).
        timed = (count == 0 or unseen <= 3) and FewRowKernel.trial_passes == trials_before
        tests = state.stats.tested - tested
        lengths.update(count, state.stats.accepted - accepted_before, tests, seconds if timed else None)
        if remaining == 0:
            break
        if count:
            state.roll_back(start, outcome)
    return state.output[:, : state.prompt_length + int(state.emitted.max())], state.stats, state.invalid


def speculate(
    target: Backend,
    draft_model: PreTrainedModel,
    kernel: FewRowKernel,
    compose: Compose,
    prompt: Prompt,
    stopping: Stopping,
    sampler: Sampler,
    config: DecodingConfig,
    stream: TokenStream = NO_STREAM,
) -> tuple[torch.Tensor, SpeculationStats]:
    """`speculative_decode` with `config`'s K and K policy, `draft_model` run by its own backend (its linears on
    the few-row `kernel`, given back after); a NaN composition in a greedy step is an error."""
    draft = SeparateModels([draft_model], kernel)
    try:
        sequences, stats, invalid = speculative_decode(
            target, draft, compose, prompt, stopping, sampler, config.draft_tokens, config.adaptive_draft, stream
        )
    finally:
        draft.close()  # the draft's linears get their own forwards back
    if invalid:
        raise ValueError(NAN_COMPOSITION)
    return sequences, stats


def _parameters(backend: Backend) -> int:
    """The parameters a forward pass of `backend` reads: every model it runs (one shared base: once)."""
    return sum(parameter.numel() for model in backend.models for parameter in model.parameters())


class _Columns:
    """The columns the caches are built from: each row's token, mask bit and position, `(B, width)` each.

    `used` columns are in use; the last one holds each row's newest token. Each round keeps at most K+1
    columns and every row emits at least one token a round, so `P + N·(K+1)` columns always suffice."""

    def __init__(self, prompt: Prompt, pad_id: int, width: int) -> None:
        batch, self.used = prompt.input_ids.shape
        device = prompt.input_ids.device
        self.tokens = torch.full((batch, width), pad_id, dtype=prompt.input_ids.dtype, device=device)
        self.tokens[:, : self.used] = prompt.input_ids
        self.mask = torch.zeros((batch, width), dtype=prompt.attention_mask.dtype, device=device)
        self.mask[:, : self.used] = prompt.attention_mask
        dtype = torch.promote_types(prompt.position_ids.dtype, prompt.generated_position_ids.dtype)
        self.positions = torch.zeros((batch, width), dtype=dtype, device=device)
        self.positions[:, : self.used] = prompt.position_ids

    def attention_mask(self, first: int, dtype: torch.dtype | None) -> torch.Tensor:
        """The attention mask of a pass over columns first…used−1: 2D, or 4D (`attention_bias`) with a `dtype`."""
        if dtype is None or self.used - first == 1:
            return self.mask[:, : self.used]
        return attention_bias(self.mask[:, : self.used], first, dtype)


class _CachedModel:
    """A backend with its caches and the number of columns they hold."""

    def __init__(self, backend: Backend, length: int) -> None:
        self.backend = backend
        # A 4D mask for passes over several tokens, where every model of the backend takes one as given.
        self.bias_dtype = bias_dtype(backend.models)
        self.caches: Caches = backend.new_cache(length)
        for cache in self.caches:  # sliding-window layers keep their past until `crop` (transformers 5)
            if hasattr(cache, "activate_past_recording"):
                cache.activate_past_recording()
        self.cached = 0

    def forward(self, columns: _Columns, logits_to_keep: int) -> torch.Tensor:
        """Logits `(k+1, B, logits_to_keep, V)` of a pass over the columns the caches do not hold yet."""
        first, self.cached = self.cached, columns.used
        return self.backend.forward(
            columns.tokens[:, first : columns.used],
            columns.attention_mask(first, self.bias_dtype),
            columns.positions[:, first : columns.used],
            self.caches,
            logits_to_keep=logits_to_keep,
        )

    def keep(self, columns: int) -> None:
        """Cut the caches back to their first `columns` columns.

        `crop(-n)` removes n; with past recording on, `crop(0)` still trims sliding-window layers back to
        their window, as transformers' own assisted decoding does after every step."""
        if not self.cached:
            return
        dropped = max(0, self.cached - columns)
        for cache in self.caches:
            if dropped > 0 or hasattr(cache, "activate_past_recording"):
                cache.crop(-dropped)
        self.cached = min(self.cached, columns)


class _Speculation:
    """The state of one speculative `generate` call: the columns, both models' caches, and what was emitted."""

    def __init__(
        self,
        target: Backend,
        draft: Backend,
        compose: Compose,
        prompt: Prompt,
        stopping: Stopping,
        sampler: Sampler,
        num_draft_tokens: int,
    ) -> None:
        self.compose, self.prompt, self.stopping, self.sampler = compose, prompt, stopping, sampler
        batch, self.prompt_length = prompt.input_ids.shape
        self.max_new_tokens = prompt.max_new_tokens
        device = prompt.input_ids.device
        width = self.prompt_length + self.max_new_tokens * (num_draft_tokens + 1)
        self.columns = _Columns(prompt, stopping.pad_id, width)
        # The columns the caches hold when every draft is accepted; more (rows that accepted fewer) grow them.
        expected = self.prompt_length + self.max_new_tokens + num_draft_tokens + 1
        self.target, self.draft = _CachedModel(target, expected), _CachedModel(draft, expected)
        # Rows that accepted fewer drafts keep masked holes, unless a sliding window would count them.
        self.holes = not any(has_sliding_window(backend.base_model) for backend in (target, draft))
        # The output, with room for one round past the end (writes there are dropped).
        output_width = self.prompt_length + self.max_new_tokens + num_draft_tokens + 1
        self.output = torch.full((batch, output_width), stopping.pad_id, dtype=prompt.input_ids.dtype, device=device)
        self.output[:, : self.prompt_length] = prompt.input_ids
        self.emitted = torch.zeros(batch, dtype=torch.long, device=device)  # (B,) tokens each row emitted
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        self.invalid = torch.zeros((), dtype=torch.bool, device=device)  # a NaN composed score, greedy
        self.offsets = torch.arange(num_draft_tokens + 1, device=device)
        self.stats = SpeculationStats(num_draft_tokens)

    def position_of(self, index: torch.Tensor) -> torch.Tensor:
        """(B, n) positions of each row's generated tokens number `index` (B, n) (past the end: the last one)."""
        return self.prompt.generated_position_ids.gather(1, index.clamp(max=self.max_new_tokens - 1))

    def propose(self, count: int) -> list[torch.Tensor]:
        """The draft proposes `count` tokens into the next columns, one pass each; returns their q_j when sampling."""
        columns = self.columns
        start = columns.used
        columns.mask[:, start : start + count] = 1
        columns.positions[:, start : start + count] = self.position_of(self.emitted.unsqueeze(1) + self.offsets[:count])
        draft_probabilities = []
        for _step in range(count):
            logits = self.draft.forward(columns, logits_to_keep=1)[0, :, -1]  # (B, V)
            if self.sampler.do_sample:
                q = self.sampler.probabilities(torch.log_softmax(logits.float(), dim=-1).unsqueeze(1)).squeeze(1)
                if torch.isnan(q).any():
                    raise ValueError(
                        "the draft produced NaN probabilities (NaN or +inf logits); check its weights and dtype"
                    )
                draft_probabilities.append(q)  # (B, V)
                proposed = torch.multinomial(q, 1, generator=self.sampler.generator).squeeze(1)  # (B,)
            else:
                proposed = logits.argmax(-1)  # (B,)
            columns.tokens[:, columns.used] = proposed
            columns.used += 1
        self.stats.draft_passes += count
        return draft_probabilities

    def verify(self, start: int, draft_probabilities: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The target scores the round in one pass: the drafts each row accepts `(B,)`, and its next token `(B,)`."""
        count = self.columns.used - start
        logits = self.target.forward(self.columns, logits_to_keep=count + 1)  # (k+1, B, count+1, V)
        scores = self.compose(logits)  # (B, count+1, V)
        drafts = self.columns.tokens[:, start : self.columns.used]  # (B, count)
        if not self.sampler.do_sample:
            self.invalid |= torch.isnan(scores).any()
            best = scores.argmax(-1)  # (B, count+1)
            accepted = greedy_accepted(best, drafts)  # (B,)
            return accepted, best.gather(1, accepted.unsqueeze(1)).squeeze(1)
        p = self.sampler.probabilities(scores)  # (B, count+1, V)
        q = torch.stack(draft_probabilities, dim=1) if count else p[:, :0]  # (B, count, V)
        table = outcome_probabilities(p, q, drafts).flatten(1)  # (B, (count+1)·V)
        choice = torch.multinomial(table, 1, generator=self.sampler.generator).squeeze(1)  # (B,)
        return choice // p.shape[-1], choice % p.shape[-1]

    def emit(self, start: int, accepted: torch.Tensor, next_tokens: torch.Tensor) -> _Outcome:
        """Each row still generating takes its accepted drafts and y, up to `max_new_tokens`, EOS and stop strings.

        Reads from the device once: the longest acceptance and what is left to do."""
        count = self.columns.used - start
        drafts = self.columns.tokens[:, start : self.columns.used]  # (B, count)
        emitted, max_new_tokens = self.emitted, self.max_new_tokens
        active = self.unfinished & (emitted < max_new_tokens)
        tests = torch.where(active, torch.where(accepted < count, accepted + 1, accepted), 0)  # before any cut
        accepted_total = torch.where(active, accepted, 0).sum()
        if not self.holes and count:
            # Every row advances by the shortest acceptance; a row that accepted more ends on its next draft.
            shortest = torch.where(active, accepted, count).min()
            cut_draft = drafts.gather(1, shortest.clamp(max=count - 1).expand(drafts.shape[0], 1)).squeeze(1)
            next_tokens = torch.where(accepted > shortest, cut_draft, next_tokens)
            accepted = torch.minimum(accepted, shortest)
        new_tokens = round_tokens(drafts, accepted, next_tokens)  # (B, count+1)
        take = torch.where(active, torch.minimum(accepted + 1, max_new_tokens - emitted), 0)  # (B,)
        step_offsets = self.offsets[: count + 1]
        if self.stopping.eos_ids is not None:
            is_eos = torch.isin(new_tokens, self.stopping.eos_ids) & (step_offsets < take.unsqueeze(1))  # (B, count+1)
            ends = is_eos.any(1)
            take = torch.where(ends, is_eos.long().argmax(1) + 1, take)  # up to and including the first EOS
            self.unfinished &= ~ends
        if self.stopping.criteria is not None:
            take = self._stop_within(self.stopping.criteria, new_tokens, take)
        written = torch.where(step_offsets < take.unsqueeze(1), new_tokens, self.stopping.pad_id)
        self.output.scatter_(1, self.prompt_length + emitted.unsqueeze(1) + step_offsets, written)
        self.emitted = emitted + take

        still = self.unfinished & (self.emitted < max_new_tokens)
        summary = torch.stack(
            [
                torch.where(active, accepted, 0).max(),
                torch.where(still, max_new_tokens - self.emitted, 0).max(),
                active.sum(),
                tests.sum(),
                accepted_total,
                take.sum(),
            ]
        ).tolist()
        longest, remaining, rows, tested, accepted_sum, emitted_sum = summary
        self.stats.rounds += 1
        self.stats.row_rounds += rows
        self.stats.drafted += count * rows
        self.stats.tested += tested
        self.stats.accepted += accepted_sum
        self.stats.emitted += emitted_sum
        return _Outcome(accepted, next_tokens, emitted, longest, remaining)

    def roll_back(self, start: int, outcome: _Outcome) -> None:
        """Cut back to the round's longest acceptance (rows that accepted fewer keep masked holes), then append y."""
        columns = self.columns
        keep = start + outcome.longest
        kept = self.offsets[: outcome.longest] < outcome.accepted.unsqueeze(1)  # (B, longest)
        columns.mask[:, start:keep] = kept.to(columns.mask.dtype)
        self.target.keep(keep)
        self.draft.keep(keep)
        columns.used = keep
        columns.tokens[:, keep] = outcome.next_tokens
        columns.mask[:, keep] = 1
        columns.positions[:, keep] = self.position_of((outcome.before + outcome.accepted).unsqueeze(1)).squeeze(1)
        columns.used += 1

    def plain_step(self) -> int:
        """A round of K = 0: one pass of the target over the newest column, one token for every row still
        generating, appended as the next column. Returns the most tokens a row still generating may emit.

        What `propose(0)`, `verify`, `emit` and `roll_back` do for K = 0, without their work on drafts:
        it is the step the adaptive K falls back to, and should cost what plain decoding's step costs."""
        columns, stopping = self.columns, self.stopping
        scores = self.compose(self.target.forward(columns, logits_to_keep=1))[:, -1]  # (B, V)
        if self.sampler.do_sample:
            probabilities = self.sampler.probabilities(scores)  # (B, V)
            next_tokens = torch.multinomial(probabilities, 1, generator=self.sampler.generator).squeeze(1)  # (B,)
        else:
            self.invalid |= torch.isnan(scores).any()
            next_tokens = scores.argmax(-1)  # (B,)
        emitted = self.emitted
        active = self.unfinished & (emitted < self.max_new_tokens)  # (B,)
        take = active.long()  # (B,)
        if stopping.eos_ids is not None:
            ends = torch.isin(next_tokens, stopping.eos_ids) & active
            self.unfinished &= ~ends
        if stopping.criteria is not None:
            take = self._stop_within(stopping.criteria, next_tokens.unsqueeze(1), take)
        written = torch.where(take > 0, next_tokens, stopping.pad_id)  # (B,)
        self.output.scatter_(1, (self.prompt_length + emitted).unsqueeze(1), written.unsqueeze(1))
        self.emitted = emitted + take
        still = self.unfinished & (self.emitted < self.max_new_tokens)
        summary = torch.stack([torch.where(still, self.max_new_tokens - self.emitted, 0).max(), active.sum()])
        remaining, rows = summary.tolist()
        self.stats.rounds += 1
        self.stats.row_rounds += rows
        self.stats.emitted += rows
        self.stats.plain_rounds += 1
        if remaining:
            self.target.keep(columns.used)  # a no-op but for sliding-window layers, trimmed as after any round
            self.draft.keep(columns.used)
            columns.tokens[:, columns.used] = next_tokens
            columns.mask[:, columns.used] = 1
            columns.positions[:, columns.used] = self.position_of(emitted.unsqueeze(1)).squeeze(1)
            columns.used += 1
        return remaining

    def _stop_within(self, criteria: StopCriteria, new_tokens: torch.Tensor, take: torch.Tensor) -> torch.Tensor:
        """Cut each row's `take` at the first token that completes a stop string (marking the row finished).

        The criteria see a row's generated tokens 1…t after each token t, as in plain decoding; rows
        are checked in groups of equal length, since the criteria take a rectangular batch."""
        take = take.clone()
        generated = self.output[:, self.prompt_length :]  # (B, ...) tokens written before this round
        for step in range(new_tokens.shape[1]):
            rows = (step < take).nonzero().squeeze(1)
            if rows.numel() == 0:
                break
            before = self.emitted[rows]  # tokens written before this round
            for count in before.unique().tolist():
                group = rows[before == count]
                text = torch.cat([generated[group, :count], new_tokens[group, : step + 1]], 1)
                stopped = group[criteria(text, None)]
                take[stopped] = step + 1
                self.unfinished[stopped] = False
        return take


class _Outcome(NamedTuple):
    """What a round emitted: each row's accepted drafts `(B,)` and next token `(B,)` (after any cut for a sliding
    window), its emitted count before the round `(B,)`, the batch's longest acceptance, the most tokens left."""

    accepted: torch.Tensor
    next_tokens: torch.Tensor
    before: torch.Tensor
    longest: int
    remaining: int
