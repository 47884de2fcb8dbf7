"""Letter-replacement tasks as data: rules, splits, sampling, held-out strings, the tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from mergecompose.experiments.compare_config import EvaluationSettings
from mergecompose.experiments.tokenizer import build_tokenizer, decode_ids, encode_strings
from mergecompose.experiments.training_strings import HELD_OUT_MODULUS, is_held_out
from mergecompose.studies.letters.letters_task_type import build_eval_data
from mergecompose.studies.letters.task import (
    LetterTask,
    Skill,
    apply_replacements,
    combined_replacements,
    sample_strings,
)

ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ "
SKILLS = {"ab": {"A": "B"}, "cd": {"C": "D"}, "ac": {"A": "C"}}


@pytest.fixture(scope="module")
def task():
    return LetterTask(ALPHABET, SKILLS, ["ab", "cd"])


def test_replacements_are_simultaneous_not_chained():
    assert apply_replacements("AB", {"A": "B", "B": "A"}) == "BA"
    assert apply_replacements("ABC", {"A": "B", "B": "C"}) == "BCC"  # A → B, not A → B → C
    assert Skill("ab", {"A": "B"}).apply("CAB A") == "CBB B"


def test_joint_target_and_splits(task):
    assert task.target("CAB") == "DBB"
    assert task.target("CAB", ["ab"]) == "CBB"
    assert task.target("CAB", []) == "CAB"
    assert task.target("AAC", ["ac"]) == "CCC"
    assert [task.split_of(text) for text in ["CAB", "AB", "XCX", "XYZ "]] == ["joint", "ab", "cd", "neither"]
    assert task.split_names == ("joint", "ab", "cd", "neither")


def test_conflicting_skills_cannot_be_joint():
    with pytest.raises(ValueError, match=r"`ab` and `ac` both rewrite 'A'"):
        combined_replacements([Skill("ab", {"A": "B"}), Skill("ac", {"A": "C"})])
    with pytest.raises(ValueError, match="both rewrite"):
        LetterTask(ALPHABET, SKILLS, ["ab", "ac"])


@pytest.mark.parametrize(
    ("skills", "joint", "message"),
    [
        ({"ab": {"A": "b"}, "cd": {"C": "D"}}, ["ab", "cd"], "single characters of the alphabet"),
        ({"ab": {"AB": "C"}, "cd": {"C": "D"}}, ["ab", "cd"], "single characters"),
        ({"ab": {"A": "A"}, "cd": {"C": "D"}}, ["ab", "cd"], "replaces nothing"),
        ({"ab": {"A": "B"}, "cd": {"C": "D"}}, ["ab", "xy"], "two or more distinct skills"),
        ({"ab": {"A": "B"}, "cd": {"C": "D"}}, ["ab"], "two or more distinct skills"),
    ],
)
def test_bad_skills_are_refused(skills, joint, message):
    with pytest.raises(ValueError, match=message):
        LetterTask(ALPHABET, skills, joint)


def test_sample_strings_distinct_conditioned_and_seeded(task):
    keep = task.membership("joint")
    first = sample_strings(ALPHABET, 8, 200, np.random.default_rng(3), keep=keep)
    again = sample_strings(ALPHABET, 8, 200, np.random.default_rng(3), keep=keep)
    assert first == again
    assert len(set(first)) == 200
    assert all(len(text) == 8 and "A" in text and "C" in text for text in first)
    excluded = sample_strings(ALPHABET, 8, 50, np.random.default_rng(3), keep=keep, exclude=set(first[:10]))
    assert not set(excluded) & set(first[:10])


def test_sample_strings_refuses_an_empty_split(task):
    with pytest.raises(ValueError, match="found only 0 of 5"):
        sample_strings(ALPHABET, 1, 5, np.random.default_rng(0), keep=task.membership("joint"), max_draws=10_000)
    with pytest.raises(ValueError, match="`length` must be >= 1"):
        sample_strings(ALPHABET, 0, 5, np.random.default_rng(0))


def test_held_out_is_one_in_eight_and_deterministic():
    rng = np.random.default_rng(0)
    texts = ["".join(rng.choice(list(ALPHABET), size=10)) for _ in range(8000)]
    share = np.mean([is_held_out(text) for text in texts])
    # Binomial(8000, 1/8): standard deviation 0.0037; 5 of them either side.
    assert abs(share - 1 / HELD_OUT_MODULUS) < 0.019
    assert [is_held_out(text) for text in texts[:50]] == [is_held_out(text) for text in texts[:50]]


def test_eval_data_is_held_out_disjoint_and_in_its_split(task):
    settings = EvaluationSettings(joint_size=60, split_size=30, validation_size=20, lengths=[4, 8, 12], length_size=25)
    data = build_eval_data(task, settings, main_length=8, train_max=8)
    assert set(data.test) == {"joint", "ab", "cd", "neither", "length_12"}
    assert [len(data.test[name]) for name in ["joint", "ab", "cd", "neither", "length_12"]] == [60, 30, 30, 30, 25]
    everything = []
    for name, eval_set in [*data.test.items(), *data.validation.items()]:
        split = "joint" if name.startswith("length_") else name
        assert all(task.split_of(text) == split for text in eval_set.sources)
        assert list(eval_set.targets) == [task.target(text) for text in eval_set.sources]
        everything += list(eval_set.sources)
    for kind, by_length in data.curves.items():
        assert sorted(by_length) == [4, 8, 12]
        for length, eval_set in by_length.items():
            assert all(len(text) == length for text in eval_set.sources)
            if kind == "copy":
                assert eval_set.targets == eval_set.sources
            elif kind.startswith("skill:"):
                name = kind.removeprefix("skill:")
                assert all(task.skills[name].is_active(text) for text in eval_set.sources)
                assert list(eval_set.targets) == [task.target(text, [name]) for text in eval_set.sources]
            if kind != "joint" or length == 4:
                everything += list(eval_set.sources)
    assert data.curves["joint"][8] is data.test["joint"] and data.curves["joint"][12] is data.test["length_12"]
    assert len(everything) == len(set(everything)), "evaluation sets overlap"
    assert all(is_held_out(text) for text in everything)


# ----------------------------------------------------------------------------------- tokenizer


def test_tokenizer_ids_and_library_round_trip(tmp_path):
    tokenizer = build_tokenizer(ALPHABET)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.sep_token_id) == (0, 1, 2)
    assert len(tokenizer) == 30
    texts = ["CAB A", "Z", "THE QUICK FOX"]
    ours = encode_strings(tokenizer, texts)
    assert ours[0] == [5, 3, 4, 29, 3]
    assert ours == [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert [reloaded(text, add_special_tokens=False)["input_ids"] for text in texts] == ours
    assert decode_ids(tokenizer, [*ours[0], 1, 7, 7]) == "CAB A"
    assert decode_ids(tokenizer, [0, 0, *ours[1]]) == "Z"


def test_tokenizer_refuses_unknown_characters():
    tokenizer = build_tokenizer(ALPHABET)
    with pytest.raises(ValueError, match=r"outside the tokenizer's alphabet: \['a'\]"):
        encode_strings(tokenizer, ["AaB"])
    with pytest.raises(ValueError, match="distinct characters"):
        build_tokenizer("AAB")
