"""Stop strings and `eos_token_id=[]` in `ComposedLM.generate`, pinned against transformers' `generate`.

A character tokenizer (60 characters + 4 special tokens = the tiny models' 64 ids) turns the
tiny models' tokens into text, so every character is one token and a stop string of n characters
spans n tokens.
"""

import pytest
import torch

from mergecompose.analysis.data import char_tokenizer
from mergecompose.composition import ComposedLM
from mergecompose.core.tiny import random_llama
from mergecompose.experiments.tokenizer import build_tokenizer

CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ01234567"
PROMPTS = ["abc", "hello", "XYZ0", "q", "tuvw"]
EOS = 2  # "</s>", as in `mergecompose.core.tiny`'s config
PAD = 0  # "<pad>"


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = char_tokenizer(CHARACTERS)
    tokenizer.padding_side = "left"
    assert len(tokenizer) == 64
    return tokenizer


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """`PROMPTS` left-padded: ids and attention mask `(B, T)`."""
    batch = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    return batch["input_ids"], batch["attention_mask"]


@pytest.fixture(scope="module")
def identity(base_model, tokenizer):
    """The base composed with itself at weight 1: log p̂ = log p_b, so greedy decoding is the base's."""
    return ComposedLM(base_model, [base_model], tokenizers=tokenizer)


@pytest.fixture(scope="module")
def composed(base_model, expert_models):
    """A real composition, built without a tokenizer (generate gets one through `tokenizer=`)."""
    return ComposedLM(base_model, expert_models)


def generated_tokens(tokenizer, sequences, prompt_length):
    """Each row's generated tokens as vocabulary strings (one character each, or a special token)."""
    return [tokenizer.convert_ids_to_tokens(row[prompt_length:].tolist()) for row in sequences]


def first_stop(tokens, stop_strings):
    """Index of the token at which a stop string first occurs in the joined tokens, or None."""
    text = ""
    for index, token in enumerate(tokens):
        text += token
        if any(stop in text for stop in stop_strings):
            return index
    return None


def cut_after_stops(free, prompt_length, ends):
    """`free` with each row padded after its stop (`ends[row]`, None: no stop), cut after the last stop."""
    expected = free.clone()
    for row, end in enumerate(ends):
        if end is not None:
            expected[row, prompt_length + end + 1 :] = PAD
    if None not in ends:
        expected = expected[:, : prompt_length + max(ends) + 1]
    return expected


def test_identity_composition_stops_where_transformers_does(identity, base_model, tokenizer, prompts):
    ids, mask = prompts
    prompt_length = ids.shape[1]
    free = identity.generate(ids, mask, max_new_tokens=20, eos_token_id=EOS, pad_token_id=PAD)
    assert free.shape[1] == prompt_length + 20 and not (free[:, prompt_length:] == EOS).any()
    tokens = generated_tokens(tokenizer, free, prompt_length)
    # Strings of 2, 3 and 2 generated tokens of rows 1, 2 and 3.
    stop_strings = ["".join(tokens[1][3:5]), "".join(tokens[2][8:11]), "".join(tokens[3][4:6])]
    ends = [first_stop(row, stop_strings) for row in tokens]
    assert all(end is not None for end in ends[1:4]) and None in ends  # some rows stop, one never does

    ours = identity.generate(
        ids, mask, max_new_tokens=20, eos_token_id=EOS, pad_token_id=PAD, stop_strings=stop_strings
    )
    theirs = base_model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=20,
        do_sample=False,
        stop_strings=stop_strings,
        tokenizer=tokenizer,
        pad_token_id=PAD,
        eos_token_id=EOS,
    )
    assert torch.equal(ours, theirs)
    assert torch.equal(ours, cut_after_stops(free, prompt_length, ends))


def test_a_match_lies_in_the_generated_tokens_unlike_transformers(identity, base_model, tokenizer, prompts):
    # transformers runs its stop-string check on prompt + generated tokens; we, like lm-eval's
    # generate_until, on the generated tokens only.
    ids, mask = prompts
    prompt_length = ids.shape[1]
    free = identity.generate(ids, mask, max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD)
    tokens = generated_tokens(tokenizer, free, prompt_length)
    spanning = PROMPTS[0][-1] + tokens[0][0]  # the prompt's last character and the first generated token
    assert first_stop(tokens[0], [spanning]) is None

    ours = identity.generate(ids, mask, max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD, stop_strings=spanning)
    theirs = base_model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=8,
        do_sample=False,
        stop_strings=[spanning],
        tokenizer=tokenizer,
        pad_token_id=PAD,
        eos_token_id=EOS,
    )
    assert torch.equal(ours[0], free[0])
    assert (theirs[0, prompt_length + 1 :] == PAD).all()


def test_rows_stop_at_their_first_stop_string_and_are_padded(composed, tokenizer, prompts):
    ids, mask = prompts
    prompt_length = ids.shape[1]
    free = composed.generate(ids, mask, max_new_tokens=16, eos_token_id=[], pad_token_id=PAD)
    tokens = generated_tokens(tokenizer, free, prompt_length)

    # A stop string of row 0 only: row 0 stops at its first occurrence, the others go on to the end.
    stop = "".join(tokens[0][2:4])
    ends = [first_stop(row, [stop]) for row in tokens]
    assert ends[0] == 3 and ends[1:] == [None] * 4
    out = composed.generate(
        ids, mask, max_new_tokens=16, eos_token_id=[], pad_token_id=PAD, stop_strings=stop, tokenizer=tokenizer
    )
    assert out.shape == free.shape
    assert torch.equal(out, cut_after_stops(free, prompt_length, ends))

    # A stop string for every row: rows stop at different steps, generation ends at the last stop.
    stop_strings = ["".join(row[index + 1 : index + 3]) for index, row in enumerate(tokens)]
    ends = [first_stop(row, stop_strings) for row in tokens]
    assert len(set(ends)) > 1 and None not in ends
    out = composed.generate(
        ids, mask, max_new_tokens=16, eos_token_id=[], pad_token_id=PAD, stop_strings=stop_strings, tokenizer=tokenizer
    )
    assert out.shape[1] == prompt_length + max(ends) + 1 < free.shape[1]
    assert torch.equal(out, cut_after_stops(free, prompt_length, ends))


@pytest.mark.parametrize(
    "stop_strings, message",
    [
        ("", r"`stop_strings` must be non-empty strings .*got \[''\]"),
        (["ab", ""], r"`stop_strings` must be non-empty strings .*got \['ab', ''\]"),
        (["ab", 3], r"`stop_strings` must be a string or a list of strings, got \['ab', 3\]"),
    ],
)
def test_bad_stop_strings_are_refused(stop_strings, message, identity, prompts):
    with pytest.raises(ValueError, match=message):
        identity.generate(*prompts, max_new_tokens=2, stop_strings=stop_strings)


def test_stop_strings_need_a_tokenizer(composed, prompts):
    assert composed.tokenizer is None
    with pytest.raises(ValueError, match="`tokenizer` is needed to match `stop_strings`"):
        composed.generate(*prompts, max_new_tokens=2, stop_strings=["ab"])


def test_empty_eos_list_turns_eos_stopping_off(identity, tiny_config, prompts):
    ids, mask = prompts
    prompt_length = ids.shape[1]
    free = identity.generate(ids, mask, max_new_tokens=12, eos_token_id=EOS, pad_token_id=PAD)
    assert free.shape[1] == prompt_length + 12 and not (free[:, prompt_length:] == EOS).any()
    # A copy of the base whose generation config calls every row's first greedy token an EOS.
    base = random_llama(tiny_config, seed=0)
    base.generation_config.eos_token_id = free[:, prompt_length].tolist()
    eos_is_the_argmax = ComposedLM(base, [base])
    by_default = eos_is_the_argmax.generate(ids, mask, max_new_tokens=12, pad_token_id=PAD)
    assert torch.equal(by_default, free[:, : prompt_length + 1])  # the config's EOS still stops every row
    off = eos_is_the_argmax.generate(ids, mask, max_new_tokens=12, eos_token_id=[], pad_token_id=PAD)
    assert torch.equal(off, free)


def test_stop_strings_transformers_cannot_index_are_matched_on_decoded_text(composed, tokenizer, prompts):
    """A tokenizer without an unknown token (the tasks' letters one), or a stop string no token can
    produce, makes transformers' `StopStringCriteria` fail; those are matched on the decoded text."""
    ids, mask = prompts
    free = composed.generate(ids, mask, max_new_tokens=8, eos_token_id=[], pad_token_id=PAD)
    tokens = generated_tokens(tokenizer, free, ids.shape[1])
    never = composed.generate(
        ids, mask, max_new_tokens=8, eos_token_id=[], pad_token_id=PAD, stop_strings=["#"], tokenizer=tokenizer
    )  # "#" is no token's text
    assert torch.equal(never, free)
    # The tasks' character tokenizer has no unknown token: transformers' matcher cannot be built for it.
    without_unk = build_tokenizer(CHARACTERS + "!")  # 3 special tokens + 61 characters: vocab 64 too
    assert len(without_unk) == 64 and without_unk.unk_token is None
    tokens = generated_tokens(without_unk, free, ids.shape[1])
    stop = tokens[0][2]  # the third generated token of row 0
    stopped = composed.generate(
        ids, mask, max_new_tokens=8, eos_token_id=[], pad_token_id=PAD, stop_strings=[stop], tokenizer=without_unk
    )
    for row, row_tokens in enumerate(tokens):
        end = first_stop(row_tokens, [stop])
        expected = (
            free[row]
            if end is None
            else torch.cat([free[row, : ids.shape[1] + end + 1], torch.full((8 - end - 1,), PAD)])
        )
        assert torch.equal(stopped[row, : expected.shape[0]], expected), row
    assert first_stop(tokens[0], [stop]) is not None
