"""Decoding one token a step: transformers' warpers on the composed log-probs, and the plain decoding loop.

Each step runs every component once on the newest token (one KV cache each, or one shared), composes
their logits, and appends the argmax or a token drawn after the warpers (temperature, top-k, top-p) to
every row that has not finished.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.streamers import BaseStreamer

from mergecompose.composition.backend import Backend
from mergecompose.composition.decoding_config import DecodingConfig
from mergecompose.composition.inputs import Prompt
from mergecompose.composition.stops import Stopping

# `(k+1, ..., V)` component logits, base first -> `(..., V)` composed log-probs (the remedies applied).
Compose = Callable[[torch.Tensor], torch.Tensor]

NAN_COMPOSITION = (
    "the composed distribution was NaN at some step: a component produced NaN logits, or "
    "every token was ruled out (-inf) by some component"
)


def sampling_warpers(
    do_sample: bool, temperature: float, top_k: int | None, top_p: float | None
) -> LogitsProcessorList:
    """transformers' own warpers, applied to the composed log-probs when sampling (none for greedy decoding)."""
    warpers = LogitsProcessorList()
    if not do_sample:
        return warpers
    if temperature is not None and temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(temperature)))
    if top_k is not None and top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers


def warped_probabilities(warpers: LogitsProcessorList, scores: torch.Tensor) -> torch.Tensor:
    """softmax(warpers(scores)) at every position, `(..., V)` -> `(..., V)`: what sampling draws from.

    The warpers (temperature, top-k, top-p) look at one row of scores each, never at the ids."""
    flat = scores.reshape(-1, scores.shape[-1])  # (N, V)
    no_ids = torch.zeros((flat.shape[0], 0), dtype=torch.long, device=flat.device)
    # transformers annotates `input_ids` as torch.LongTensor, a legacy type that plain tensors do not match.
    return torch.softmax(warpers(no_ids, flat), dim=-1).view(scores.shape)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Sampler:
    """How a token is chosen from composed scores: the argmax, or a draw after the warpers (`do_sample`)."""

    do_sample: bool
    warpers: LogitsProcessorList
    generator: torch.Generator | None

    @classmethod
    def from_config(cls, config: DecodingConfig, device: torch.device) -> Sampler:
        generator = None
        if config.do_sample and config.seed is not None:
            generator = torch.Generator(device=device).manual_seed(config.seed)
        return cls(
            config.do_sample,
            sampling_warpers(config.do_sample, config.temperature, config.top_k, config.top_p),
            generator,
        )

    def probabilities(self, scores: torch.Tensor) -> torch.Tensor:
        """`(..., V)` scores -> the warped probabilities a draw uses, at every position."""
        return warped_probabilities(self.warpers, scores)


class TokenStream:
    """The tokens of one row as they are decided, handed to transformers' streamer protocol (`BaseStreamer`:
    `put(tokens)`, `end()`), as its `generate` hands them: the prompt first, then the new tokens, then `end()`."""

    def __init__(self, streamer: BaseStreamer | None) -> None:
        self.streamer = streamer

    @classmethod
    def check(cls, streamer: BaseStreamer | None, input_ids: torch.Tensor) -> TokenStream:
        """The stream of `streamer` for the prompt `input_ids` `(B, P)`, which is put at once; one row only."""
        if streamer is not None:
            if not callable(getattr(streamer, "put", None)) or not callable(getattr(streamer, "end", None)):
                raise TypeError(f"`streamer` must have put() and end() (a BaseStreamer), got {type(streamer).__name__}")
            if input_ids.shape[0] != 1:
                raise ValueError(f"`streamer` streams one row: a batch of 1 prompt, got {input_ids.shape[0]}")
            streamer.put(input_ids.cpu())
        return cls(streamer)

    def put(self, tokens: torch.Tensor) -> None:
        """`tokens` `(n,)`, the row's new tokens."""
        if self.streamer is not None and tokens.numel():
            self.streamer.put(tokens.cpu())

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()


NO_STREAM = TokenStream(None)


@torch.no_grad()
def sample(
    backend: Backend,
    compose: Compose,
    prompt: Prompt,
    stopping: Stopping,
    sampler: Sampler,
    stream: TokenStream = NO_STREAM,
) -> torch.Tensor:
    """Decode up to `prompt.max_new_tokens` tokens; returns `(B, P + n)`, the prompt and the generated tokens.

    Greedy steps are checked for NaN on the device and the flag is read once at the end, so the loop
    has no host sync but the "how many rows are unfinished?" check; `compose` refuses NaN itself when
    sampling. When that count falls to half the rows still in the pass or fewer, the finished rows leave
    it (`Backend.keep_rows` on the caches): a batch's last long row no longer costs a pass over the whole
    batch. A greedy row decodes what it decodes alone (tests/composition/test_finished_rows_leave.py);
    a seed repeats its draws, which, as before, depend on the rows drawn beside them."""
    input_ids, pad_id = prompt.input_ids, stopping.pad_id
    device = input_ids.device
    batch, prompt_length = input_ids.shape
    total = prompt_length + prompt.max_new_tokens
    # Preallocated buffers: each step writes one column, nothing is re-concatenated.
    sequences = torch.full((batch, total), pad_id, dtype=input_ids.dtype, device=device)
    sequences[:, :prompt_length] = input_ids
    full_mask = torch.ones((batch, total), dtype=prompt.attention_mask.dtype, device=device)
    full_mask[:, :prompt_length] = prompt.attention_mask
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    invalid = torch.zeros((), dtype=torch.bool, device=device)

    cache = backend.new_cache(total)
    logits = backend.forward(input_ids, prompt.attention_mask, prompt.position_ids, cache, logits_to_keep=1)
    length = prompt_length
    # The rows still in the pass (b of the B), once finished rows have left it; None while all B are in it.
    live: torch.Tensor | None = None
    live_mask, live_positions = full_mask, prompt.generated_position_ids  # (b, total), (b, N)
    for _ in range(prompt.max_new_tokens):
        scores = compose(logits[:, :, -1])  # (k+1, b, V) -> (b, V)
        if sampler.do_sample:
            rows = sequences if live is None else sequences[live]
            # transformers annotates `input_ids` as torch.LongTensor, a legacy type that plain tensors do not match.
            scores = sampler.warpers(rows[:, :length], scores)  # type: ignore[arg-type]
            probabilities = torch.softmax(scores, dim=-1)
            next_tokens = torch.multinomial(probabilities, 1, generator=sampler.generator).squeeze(1)  # (b,)
        else:
            invalid |= torch.isnan(scores).any()
            next_tokens = scores.argmax(dim=-1)  # (b,)
        next_tokens = torch.where(unfinished, next_tokens, pad_id)
        if live is None:
            sequences[:, length] = next_tokens
        else:
            sequences[live, length] = next_tokens
        stream.put(next_tokens)  # (1,) where a streamer is given
        length += 1
        generated = (sequences if live is None else sequences[live])[:, prompt_length:length]
        unfinished = stopping.unfinished_after(unfinished, next_tokens, generated)
        if length == total:
            break
        if stopping.can_finish:
            running = int(unfinished.sum())
            if running == 0:
                break
            if running <= unfinished.shape[0] // 2:
                keep = unfinished.nonzero().squeeze(1)  # (running,)
                backend.keep_rows(cache, keep, unfinished.shape[0])
                live = keep if live is None else live[keep]
                unfinished, next_tokens = unfinished[keep], next_tokens[keep]
                live_mask, live_positions = live_mask[keep], live_positions[keep]
        step = length - prompt_length - 1  # index of the token just generated
        logits = backend.forward(
            next_tokens[:, None],
            live_mask[:, :length],
            live_positions[:, step : step + 1],
            cache,
            logits_to_keep=1,
        )
    if invalid:
        raise ValueError(NAN_COMPOSITION)
    return sequences[:, :length]
