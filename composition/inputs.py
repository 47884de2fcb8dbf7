"""Token ids, attention masks and positions, checked and converted once, before any forward pass.

Prompts are left-padded (`attention_mask` rows 0…0 1…1); positions skip the padding unless given.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Prompt:
    """A checked, left-padded prompt on the composition's device, and the position of each token to generate."""

    input_ids: torch.Tensor  # (B, P)
    attention_mask: torch.Tensor  # (B, P)
    position_ids: torch.Tensor  # (B, P)
    generated_position_ids: torch.Tensor  # (B, N), N = max_new_tokens

    @property
    def max_new_tokens(self) -> int:
        return self.generated_position_ids.shape[1]

    @property
    def positions(self) -> torch.Tensor:
        """`(B, P + N)`: the prompt's positions, then each generated token's."""
        return torch.cat([self.position_ids, self.generated_position_ids], dim=1)


def prepare_prompt(
    input_ids: object,
    attention_mask: object,
    position_ids: object,
    generated_position_ids: object,
    *,
    max_new_tokens: int,
    truncate: bool,
    vocabulary: int,
    context: int | None,
    device: torch.device,
) -> Prompt:
    """The prompt of `ComposedLM.generate`, checked and on `device`, with the positions of the tokens to generate.

    With `truncate`, a prompt too long for `context` loses its oldest tokens (and a warning says so);
    otherwise a prompt and `max_new_tokens` that need more positions than `context` are refused."""
    if truncate and (position_ids is not None or generated_position_ids is not None):
        raise ValueError(
            "`truncate=True` needs the default positions; drop `position_ids` and `generated_position_ids`"
        )
    ids, mask, positions = prepare_inputs(input_ids, attention_mask, position_ids, vocabulary, device)
    if truncate:
        # The warning names the frame of torch's `no_grad` wrapper around `generate`, four up.
        ids, mask, positions = truncate_prompt(ids, mask, max_new_tokens, context, stacklevel=4)
    check_left_padded(mask)
    what = f"the prompt ({ids.shape[1]} tokens a row) plus `max_new_tokens`={max_new_tokens}"
    if generated_position_ids is None and context is not None and ids.shape[1] > 0:
        # Refused before the positions of the tokens to generate are allocated, at any size of `max_new_tokens`.
        check_context(positions[:, -1:] + max_new_tokens, what, context)
    prompt = Prompt(
        ids, mask, positions, generated_positions(positions, generated_position_ids, max_new_tokens, device)
    )
    check_context(prompt.positions, what, context)
    return prompt


def as_token_ids(value: object, name: str = "input_ids") -> torch.Tensor:
    """`value` as a non-empty `(batch, seq)` integer tensor; a list of equal-length lists is converted.

    Raises TypeError for something that is not a tensor or a list, or holds no integers; ValueError
    for another shape. The range of the ids is checked where the vocabulary is known."""
    if isinstance(value, (list, tuple)):
        try:
            value = torch.tensor(value)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(
                f"`{name}` must be a (batch, seq) tensor or a list of equal-length lists of token ids; "
                f"could not convert the list: {error}"
            ) from None
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"`{name}` must be a (batch, seq) torch.Tensor of token ids (or a list of lists), "
            f"got {type(value).__name__}"
        )
    if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
        raise TypeError(f"`{name}` must hold integer token ids, got dtype {value.dtype}")
    if value.dim() != 2 or value.numel() == 0:
        raise ValueError(f"`{name}` must be a non-empty (batch, seq) tensor, got shape {tuple(value.shape)}")
    return value


def as_mask(value: object, shape: tuple[int, ...] | torch.Size, name: str = "attention_mask") -> torch.Tensor:
    """`value` as a long tensor of 0s and 1s of `shape`; a list is converted. Errors name the bad value."""
    if isinstance(value, (list, tuple)):
        try:
            value = torch.tensor(value)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(
                f"`{name}` must be a tensor or a list of equal-length lists of 0/1; could not convert it: {error}"
            ) from None
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"`{name}` must be a torch.Tensor of 0s and 1s (or a list of lists), got {type(value).__name__}"
        )
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"`{name}` must have the shape of `input_ids` {tuple(shape)}, got {tuple(value.shape)}")
    invalid = (value != 0) & (value != 1)
    if invalid.any():
        raise ValueError(
            f"`{name}` must hold only 0 and 1 (1 = a token, 0 = padding), got {value[invalid][0].item()!r}"
        )
    return value.long()


def prepare_inputs(
    input_ids: object, attention_mask: object, position_ids: object, vocabulary: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check the inputs and move them to `device`; default positions skip left padding. Returns all three `(B, T)`."""
    ids = as_token_ids(input_ids).to(device)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocabulary:
        raise ValueError(
            f"`input_ids` must be token ids in [0, {vocabulary}) (the model's vocabulary), "
            f"got {low if low < 0 else high}"
        )
    mask = as_mask(torch.ones_like(ids) if attention_mask is None else attention_mask, ids.shape).to(device)
    positions = as_token_ids(default_positions(mask) if position_ids is None else position_ids, "position_ids")
    if positions.shape != ids.shape:
        raise ValueError(
            f"`position_ids` must have the shape of `input_ids` {tuple(ids.shape)}, got {tuple(positions.shape)}"
        )
    return ids, mask, positions.to(device)


def default_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: (B, T), 0 at each row's first real token."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def check_left_padded(attention_mask: torch.Tensor) -> None:
    # Left padding means each row is non-decreasing: 0…0 1…1.
    if (attention_mask[:, 1:] < attention_mask[:, :-1]).any():
        raise ValueError(
            "`attention_mask` must be left-padded for generation (rows of the form 0…0 1…1); "
            "got a row with padding on the right. Set `tokenizer.padding_side = 'left'`."
        )
    if (attention_mask[:, -1] == 0).any():
        raise ValueError("`attention_mask` has a row with no tokens; every prompt needs at least one")


def truncate_prompt(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, limit: int | None, stacklevel: int = 2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep the last `limit - max_new_tokens` columns of a (left-padded) prompt, and say so (a UserWarning)."""
    if limit is None or input_ids.shape[1] + max_new_tokens <= limit:
        return input_ids, attention_mask, default_positions(attention_mask)
    keep = limit - max_new_tokens
    if keep < 1:
        raise ValueError(
            f"`max_new_tokens`={max_new_tokens} leaves no room for a prompt in the model's context of {limit}"
        )
    dropped = attention_mask[:, :-keep].sum(dim=1)  # (B,) real tokens cut from each row
    warnings.warn(
        f"truncate: cut the oldest tokens of {int((dropped > 0).sum())} of {input_ids.shape[0]} prompts "
        f"(up to {int(dropped.max())} tokens) to fit {keep} prompt + {max_new_tokens} new tokens into the "
        f"model's context of {limit}",
        UserWarning,
        stacklevel=stacklevel,
    )
    attention_mask = attention_mask[:, -keep:]
    return input_ids[:, -keep:], attention_mask, default_positions(attention_mask)


def generated_positions(
    position_ids: torch.Tensor, given: object, max_new_tokens: int, device: torch.device
) -> torch.Tensor:
    """`(B, max_new_tokens)` positions of the tokens to generate: `given`, or one past the last prompt position each."""
    if given is None:
        given = position_ids[:, -1:] + 1 + torch.arange(max_new_tokens, device=device)
    positions = as_token_ids(given, "generated_position_ids")
    batch = position_ids.shape[0]
    if positions.shape != (batch, max_new_tokens):
        raise ValueError(
            f"`generated_position_ids` must be (batch, max_new_tokens) = ({batch}, {max_new_tokens}), "
            f"got {tuple(positions.shape)}"
        )
    return positions.to(device)  # (B, max_new_tokens)


def check_context(positions: torch.Tensor, what: str, limit: int | None) -> None:
    """Refuse positions beyond the model's context: past it a model fails or silently degrades."""
    needed = int(positions.max()) + 1
    if limit is not None and needed > limit:
        raise ValueError(
            f"{what} needs {needed} positions, beyond the model's context of {limit} (`max_position_embeddings`); "
            "shorten it (`generate` can cut a prompt's oldest tokens with truncate=True)"
        )


def checked_logprobs(logits: torch.Tensor, names: list[str]) -> torch.Tensor:
    """log_softmax of every component's logits `(k+1, B, T, V)`, refusing NaN; the error names the component."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    invalid = torch.isnan(logprobs)
    if invalid.any():
        component, row, position = invalid.nonzero()[0].tolist()[:3]
        raise ValueError(
            f"component {names[component]!r} produced NaN log-probs at row {row}, position {position} (NaN or +inf "
            "logits); check its weights and dtype"
        )
    return logprobs
