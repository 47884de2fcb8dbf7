"""Text in, batches out: jsonl records, a character-level tokenizer, left-padded batches.

A record is `{"text": ...}` or `{"prompt": ..., "completion": ...}`. The measured positions of a
record are those whose next token is observed text: every position but the last for `text`,
and the positions that predict the completion's tokens for prompt/completion records.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# ids 0-3, as in `mergecompose.core.tiny`'s config
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
# Above this share of unknown tokens `encode_records` warns: the tokenizer does not cover the text.
UNKNOWN_SHARE_WARNING = 0.05


@dataclass(frozen=True)
class Record:
    """One jsonl line: `prompt` is "" for a plain `text` record."""

    prompt: str
    completion: str


def read_jsonl(path: str | os.PathLike, max_records: int | None = None) -> list[Record]:
    """Read `{"text": ...}` or `{"prompt": ..., "completion": ...}` records, one JSON object a line.

    Errors name the file and the line: a line that is not UTF-8, not JSON or not such a record."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"`data` must be an existing .jsonl file, got {str(path)!r}")
    records = []
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"{path}:{number} is not UTF-8 text: byte {raw[error.start : error.start + 1]!r} ({error.reason}); "
                    "save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number} is not valid JSON: {error}") from None
            if isinstance(item, dict) and isinstance(item.get("text"), str):
                records.append(Record("", item["text"]))
            elif (
                isinstance(item, dict)
                and isinstance(item.get("prompt"), str)
                and isinstance(item.get("completion"), str)
            ):
                records.append(Record(item["prompt"], item["completion"]))
            else:
                keys = sorted(item) if isinstance(item, dict) else type(item).__name__
                raise ValueError(
                    f'{path}:{number}: a record must be {{"text": str}} or '
                    f'{{"prompt": str, "completion": str}}, got keys {keys}'
                )
            if max_records is not None and len(records) >= max_records:
                break
    if not records:
        raise ValueError(f"`data` file {str(path)!r} holds no records")
    return records


def char_tokenizer(
    characters: str | Sequence[str], special_tokens: Mapping[str, str] | None = None
) -> PreTrainedTokenizerFast:
    """A character-level `PreTrainedTokenizerFast` built locally with the `tokenizers` library.

    `special_tokens` maps transformers' names to tokens (default `SPECIAL_TOKENS`: `<pad>`, `<s>`,
    `</s>`, `<unk>`); they take ids 0, 1, … in that order, then one id per character in the given
    order. Every character is its own token (newlines included). Unknown characters map to the
    `unk_token` where there is one, and raise otherwise.
    """
    special_tokens = dict(SPECIAL_TOKENS if special_tokens is None else special_tokens)
    characters = list(dict.fromkeys(characters))
    if any(len(c) != 1 for c in characters):
        raise ValueError(f"`characters` must be single characters, got {[c for c in characters if len(c) != 1]}")
    vocab = {token: index for index, token in enumerate([*special_tokens.values(), *characters])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=special_tokens.get("unk_token")))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special_tokens)


@dataclass(frozen=True)
class Encoded:
    """Token ids of one record; `prompt_length` tokens of prompt come first."""

    ids: list[int]
    prompt_length: int


def encode_records(
    records: Sequence[Record], tokenizer, max_length: int, truncate: bool = False, limit_name: str = "`max_length`"
) -> list[Encoded]:
    """Tokenize each record: the prompt with the tokenizer's special tokens, the completion without.

    A record longer than `max_length` tokens is an error, unless `truncate`: then it is cut to
    `max_length` tokens and a warning says how many records and tokens were cut. `limit_name` says
    in those messages where the limit comes from. A record left with no measurable position (fewer
    than two tokens, or no completion token within `max_length`) is an error. More than
    `UNKNOWN_SHARE_WARNING` of unknown tokens gets a warning with their share.
    """
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"`max_length` must be an integer >= 2, got {max_length!r}")
    if not records:
        raise ValueError("`records` is empty; nothing to encode")
    encoded, too_long, dropped = [], [], 0
    for index, record in enumerate(records):
        if record.prompt:
            prompt = tokenizer(record.prompt)["input_ids"]
            completion = tokenizer(record.completion, add_special_tokens=False)["input_ids"]
        else:
            prompt, completion = [], tokenizer(record.completion)["input_ids"]
        ids = prompt + completion
        if len(ids) > max_length:
            too_long.append((index, len(ids)))
            dropped += len(ids) - max_length
            ids = ids[:max_length]
        prompt_length = len(prompt)
        if len(ids) < 2 or len(ids) <= max(prompt_length, 1):
            raise ValueError(
                f"record {index} has no measurable position after tokenization (prompt {len(prompt)} "
                f"tokens, completion {len(completion)} tokens, limit {max_length} from {limit_name})"
            )
        encoded.append(Encoded(ids, prompt_length))
    if too_long:
        index, length = max(too_long, key=lambda item: item[1])
        counts = f"{len(too_long)} of {len(records)} records are longer than {max_length} tokens ({limit_name})"
        if not truncate:
            raise ValueError(
                f"{counts}, the longest (record {index}) has {length}; pass truncate=True (`--truncate`) to cut them"
            )
        warnings.warn(
            f"{counts}: cut them to {max_length} tokens, dropping {dropped} tokens", UserWarning, stacklevel=2
        )
    _warn_unknown_tokens(encoded, tokenizer)
    return encoded


def _warn_unknown_tokens(encoded: Sequence[Encoded], tokenizer) -> None:
    unknown = getattr(tokenizer, "unk_token_id", None)
    if unknown is None:
        return
    total = sum(len(item.ids) for item in encoded)
    count = sum(item.ids.count(unknown) for item in encoded)
    if count > UNKNOWN_SHARE_WARNING * total:
        warnings.warn(
            f"{count / total:.0%} of the tokens ({count} of {total}) are the unknown token {tokenizer.unk_token!r}: "
            "the tokenizer does not cover this text, and what is measured there is the model's view of that token",
            UserWarning,
            stacklevel=3,
        )


def measure_mask(encoded: Encoded) -> list[bool]:
    """Which positions are measured: those whose next token is observed completion (or text)."""
    first = max(encoded.prompt_length - 1, 0)
    return [first <= t < len(encoded.ids) - 1 for t in range(len(encoded.ids))]


def make_batches(encoded: Sequence[Encoded], batch_size: int, pad_token_id: int) -> list[dict[str, torch.Tensor]]:
    """Left-padded batches: `input_ids`, `attention_mask` and `measure_mask`, each `(B, T)`."""
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {batch_size}")
    batches = []
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        width = max(len(e.ids) for e in chunk)
        ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(chunk), width), dtype=torch.long)
        measured = torch.zeros((len(chunk), width), dtype=torch.bool)
        for row, item in enumerate(chunk):
            offset = width - len(item.ids)
            ids[row, offset:] = torch.tensor(item.ids)
            attention[row, offset:] = 1
            measured[row, offset:] = torch.tensor(measure_mask(item))
        batches.append({"input_ids": ids, "attention_mask": attention, "measure_mask": measured})
    return batches


def prompt_batches(
    encoded: Sequence[Encoded], batch_size: int, pad_token_id: int, prompt_tokens: int
) -> list[dict[str, torch.Tensor]]:
    """Left-padded prompts for rollouts: a record's prompt, or the first `prompt_tokens` tokens of a text."""
    if prompt_tokens < 1:
        raise ValueError(f"`prompt_tokens` must be >= 1, got {prompt_tokens}")
    prompts = [Encoded(e.ids[: e.prompt_length or prompt_tokens], 0) for e in encoded]
    batches = make_batches(prompts, batch_size, pad_token_id)
    for batch in batches:
        del batch["measure_mask"]
    return batches
