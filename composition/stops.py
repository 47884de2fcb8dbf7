"""When a generated row is finished: at an EOS id, or once its generated text completes a stop string."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase, StopStringCriteria

from mergecompose.composition.decoding_config import is_integer


class StopCriteria(Protocol):
    """A stopping criterion as transformers calls one: `(generated (B, N), scores) -> (B,)` bool, True = stop."""

    def __call__(self, generated: torch.Tensor, scores: None, /) -> torch.Tensor: ...


@dataclass(frozen=True)
class Stopping:
    """The EOS ids, the stop strings' criteria, and the id that fills a row's positions after it finished."""

    eos_ids: torch.Tensor | None  # (E,), or None: no EOS stopping
    pad_id: int
    criteria: StopCriteria | None

    @property
    def can_finish(self) -> bool:
        return self.eos_ids is not None or self.criteria is not None

    def unfinished_after(self, unfinished: torch.Tensor, tokens: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
        """`unfinished` `(B,)` after each row appended `tokens` `(B,)`; `generated` `(B, n)` ends with them."""
        if self.eos_ids is not None:
            unfinished = unfinished & ~torch.isin(tokens, self.eos_ids)
        if self.criteria is not None:
            # (B,): a stop string ends in the token just appended; the prompt is not looked at.
            unfinished = unfinished & ~self.criteria(generated, None)
        return unfinished


def special_ids(
    eos_token_id: object,
    pad_token_id: object,
    generation_config: GenerationConfig | None,
    vocabulary: int,
    device: torch.device,
) -> tuple[torch.Tensor | None, int]:
    """The EOS ids `(E,)` (None: no EOS stopping) and the pad id, given or from the base's generation config.

    The pad id defaults to the first EOS id, then to 0."""
    if eos_token_id is None and generation_config is not None:
        eos_token_id = generation_config.eos_token_id
    if pad_token_id is None and generation_config is not None:
        pad_token_id = generation_config.pad_token_id
    eos_ids = None
    if eos_token_id is not None:
        eos_list = [eos_token_id] if is_integer(eos_token_id) else eos_token_id
        if (
            isinstance(eos_list, (str, bytes))
            or not isinstance(eos_list, Sequence)
            or not all(is_integer(i) and 0 <= i < vocabulary for i in eos_list)
        ):
            raise ValueError(
                f"`eos_token_id` (given, or the base model's generation config's) must be a token id in "
                f"[0, {vocabulary}) or a list of them ([] for no EOS stopping), got {eos_token_id!r}"
            )
        if eos_list:  # an explicit [] means: no EOS stopping
            eos_ids = torch.tensor(list(eos_list), device=device)
            if pad_token_id is None:
                pad_token_id = eos_list[0]
    if pad_token_id is not None and not (is_integer(pad_token_id) and 0 <= pad_token_id < vocabulary):
        raise ValueError(
            f"`pad_token_id` (given, or the base model's generation config's) must be a token id in "
            f"[0, {vocabulary}), got {pad_token_id!r}"
        )
    return eos_ids, (0 if pad_token_id is None else int(pad_token_id))


def stop_criteria(stop_strings: object, tokenizer: PreTrainedTokenizerBase | None) -> StopCriteria | None:
    """transformers' stop-string matcher for `stop_strings`, or None when there are none."""
    if stop_strings is None:
        return None
    stop_strings = [stop_strings] if isinstance(stop_strings, str) else stop_strings
    if not isinstance(stop_strings, Sequence) or not all(isinstance(text, str) for text in stop_strings):
        raise ValueError(f"`stop_strings` must be a string or a list of strings, got {stop_strings!r}")
    if not stop_strings:
        return None
    if any(text == "" for text in stop_strings):
        raise ValueError(
            f"`stop_strings` must be non-empty strings (an empty one would match everywhere), got {stop_strings!r}"
        )
    if tokenizer is None:
        raise ValueError(
            "`tokenizer` is needed to match `stop_strings` against generated tokens, and this ComposedLM has "
            "none; pass `tokenizer=` (the base model's tokenizer)"
        )
    try:
        return StopStringCriteria(tokenizer, list(stop_strings))
    except Exception:  # noqa: BLE001 - transformers cannot index this tokenizer's vocabulary for these strings
        # e.g. a tokenizer without an unknown token, or a stop string no token can produce.
        return DecodedStops(tokenizer, list(stop_strings))


class DecodedStops:
    """Stop strings matched on decoded text, where transformers' `StopStringCriteria` cannot be built.

    A row is finished once a stop string occurs in the decoded text of its generated tokens (as
    lm-eval's own stopping criterion matches them, on the last tokens only); a string no token
    sequence decodes to never matches. Called like a stopping criterion: `(generated (B, N), scores) -> (B,)` bool.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_strings: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        # Called after every step: a match that ends in the newest token lies within the last
        # `longest` tokens (each token is at least one character), and earlier ones were seen before.
        self.window = max(len(text) for text in stop_strings)

    def __call__(self, generated: torch.Tensor, scores: None = None) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(generated[:, -self.window :].tolist(), skip_special_tokens=False)
        done = [any(stop in text for stop in self.stop_strings) for text in texts]
        return torch.tensor(done, dtype=torch.bool, device=generated.device)
