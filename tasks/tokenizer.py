"""A character-level transformers tokenizer: one token per character, plus three special tokens.

Built with the `tokenizers` library (WordLevel over single characters, `Fuse` decoder), wrapped
as a `PreTrainedTokenizerFast`, so it is saved with every checkpoint and reloads with
`AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, SEP = "<pad>", "<eos>", "<sep>"
SPECIAL_TOKENS = (PAD, EOS, SEP)  # ids 0, 1, 2; characters follow in alphabet order


def build_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """`<pad>`=0, `<eos>`=1, `<sep>`=2, then one id per character of `alphabet`, in order."""
    if len(alphabet) == 0 or len(set(alphabet)) != len(alphabet):
        raise ValueError(f"`alphabet` must be a non-empty string of distinct characters, got {alphabet!r}")
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *alphabet])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS, sep_token=SEP)


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
