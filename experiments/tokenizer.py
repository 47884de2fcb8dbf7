"""A character-level transformers tokenizer: one token per character, plus three special tokens.

Built by `mergecompose.analysis.data.char_tokenizer` (WordLevel over single characters, `Fuse` decoder), a
`PreTrainedTokenizerFast`, so it is saved with every checkpoint and reloads with
`AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerFast

from mergecompose.analysis.data import char_tokenizer

PAD, EOS, SEP = "<pad>", "<eos>", "<sep>"  # ids 0, 1, 2; characters follow in alphabet order


def build_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """`<pad>`=0, `<eos>`=1, `<sep>`=2, then one id per character of `alphabet`, in order."""
    if len(alphabet) == 0 or len(set(alphabet)) != len(alphabet):
        raise ValueError(f"`alphabet` must be a non-empty string of distinct characters, got {alphabet!r}")
    return char_tokenizer(alphabet, {"pad_token": PAD, "eos_token": EOS, "sep_token": SEP})


def encode_strings(tokenizer: PreTrainedTokenizerFast, texts: Sequence[str]) -> list[list[int]]:
    """One id per character; a character outside the tokenizer's alphabet raises a ValueError."""
    vocab = tokenizer.get_vocab()
    encoded = []
    for text in texts:
        unknown = sorted({character for character in text if character not in vocab})
        if unknown:
            raise ValueError(f"string {text!r} has characters outside the tokenizer's alphabet: {unknown}")
        encoded.append([vocab[character] for character in text])
    return encoded


def decode_ids(tokenizer: PreTrainedTokenizerFast, ids: Sequence[int]) -> str:
    """The characters of `ids`, up to (not including) the first `<eos>`; padding is dropped."""
    ids = list(ids)
    if tokenizer.eos_token_id in ids:
        ids = ids[: ids.index(tokenizer.eos_token_id)]
    return tokenizer.decode([i for i in ids if i != tokenizer.pad_token_id])
