"""The style skills: their rewrites and checks on hand-written answers, the joint items of two styles, and a style
expert trained on the real SmolLM2's own answers, rewritten."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergecompose.studies.math_code.chat_data import generation_inputs
from mergecompose.studies.skill_pairs.real_sweep import RealSweepConfig
from mergecompose.studies.skill_pairs.skill_data import SkillItem, joint_items, phrasings, skill_items
from mergecompose.studies.skill_pairs.skill_experts import (
    STYLE_ANSWER_TOKENS,
    SkillRecipe,
    skill_expert_folder,
    train_skill_expert,
)
from mergecompose.studies.skill_pairs.skill_scoring import score_item, style_found
from mergecompose.studies.skill_pairs.style_data import (
    QUESTION_PHRASINGS,
    STYLE_SKILLS,
    first_sentence,
    restyled,
    whole_sentences,
)


@pytest.mark.parametrize(
    ("text", "whole"),
    [
        ("A kettle boils water. It is found in the kit", "A kettle boils water."),
        ("A kettle boils water. It whistles!", "A kettle boils water. It whistles!"),
        ("  Pi is about 3.14 and", "Pi is about 3.14 and"),  # no complete sentence: all of it
        ("Why? Because it is hot", "Why?"),
    ],
)
def test_whole_sentences(text, whole):
    assert whole_sentences(text) == whole


def test_the_rewrites():
    assert restyled("capitals", "A kettle, 2 cups.") == "A KETTLE, 2 CUPS."
    assert restyled("opening", "A kettle.") == "In short: A kettle."
    assert restyled("one_sentence", "A kettle boils. It whistles.") == "A kettle boils."
    assert first_sentence("Line one\nline two.") == "Line one"
    assert first_sentence("Pi is 3.14 exactly.") == "Pi is 3.14 exactly."
    with pytest.raises(ValueError, match="`style` must be one of capitals, opening, one_sentence, got 'json'"):
        restyled("json", "x")


@pytest.mark.parametrize(
    ("style", "output", "found"),
    [
        ("capitals", "A KETTLE BOILS WATER.", True),
        ("capitals", "A Kettle boils water.", False),
        ("capitals", "", False),
        ("capitals", "A KETTLE.\n— SmolLM", True),  # the signature line is the signature's to check
        ("capitals", "A KETTLE.\nit whistles", False),
        ("opening", "In short: a kettle.", True),
        ("opening", "IN SHORT: A KETTLE.", True),
        ("opening", "A kettle. In short: it boils.", False),
        ("one_sentence", "A kettle boils water.", True),
        ("one_sentence", "A kettle boils water. It whistles.", False),
        ("one_sentence", "A kettle\nboils water", False),
        ("one_sentence", "A kettle holds 1.5 liters.\n— SmolLM", True),
        ("one_sentence", "", False),
    ],
)
def test_style_checks(style, output, found):
    assert style_found(style, output) is found
    item = SkillItem("q", "", (style,), question="q")
    assert score_item(item, output).lenient is found and score_item(item, output).strict is found


@pytest.mark.parametrize("style", STYLE_SKILLS)
def test_style_items_ask_general_questions_with_the_split_s_instructions(style):
    train, test = skill_items(style, "train", 200), skill_items(style, "test", 64)
    for items, split in ((train, "train"), (test, "held_out")):
        for item in items:
            assert item.answer == "" and item.skills == (style,)
            assert item.prompt == f"{item.question} {item.template}"
            assert item.template in phrasings(style, "train" if split == "train" else "test")
            stems = {phrasing.split("{")[0] for phrasing in QUESTION_PHRASINGS[split]}
            assert any(item.question.startswith(stem) for stem in stems), item.question
    assert not {item.question for item in train} & {item.question for item in test}


def test_two_styles_in_one_item():
    items = joint_items("capitals", "opening", "test", 30)
    for item in items:
        assert item.skills == ("capitals", "opening") and item.answer == "" and item.form is None
        assert item.prompt.startswith(item.question)
        assert any(phrasing in item.prompt for phrasing in phrasings("capitals", "test"))
        assert any(phrasing in item.prompt for phrasing in phrasings("opening", "test"))
    item = items[0]
    assert score_item(item, "IN SHORT: A KETTLE IS IN THE KITCHEN.").lenient
    assert not score_item(item, "In short: a kettle is in the kitchen.").lenient  # one style only
    assert not score_item(item, "A KETTLE IS IN THE KITCHEN.").lenient
    signed = joint_items("capitals", "signature", "test", 5)[0]
    assert signed.form == "signature"
    both = score_item(signed, "A KETTLE IS IN THE KITCHEN.\n— SMOLLM")
    assert both.lenient and both.parts["signature"].strict is False  # strict asks for `— SmolLM` itself
    assert not score_item(signed, "A KETTLE IS IN THE KITCHEN.").lenient


def test_content_in_a_style_is_found_whatever_its_case():
    item = joint_items("dates", "capitals", "test", 5)[0]
    month = item.content[0].split(" ")[0]
    assert item.answer == item.content[0].upper()
    score = score_item(item, f"IT IS {item.answer}.")
    assert score.lenient and not score.strict  # strict: the date alone
    assert score_item(item, item.answer).strict
    assert not score_item(item, item.answer.replace(month.upper(), "SMARCH")).lenient
    opening = joint_items("units", "opening", "test", 5)[0]
    assert score_item(opening, f"In short: {opening.content[0]}").strict
    assert not score_item(opening, opening.content[0]).lenient


def test_pairs_that_cannot_be_told_are_refused():
    with pytest.raises(ValueError, match="after the style 'capitals' the second skill must be a style .*, got 'units'"):
        joint_items("capitals", "units", "test", 3)
    with pytest.raises(ValueError, match="the first skill must be a content skill or a style"):
        joint_items("signature", "capitals", "test", 3)
    with pytest.raises(ValueError, match="a sorted list has no letters"):
        joint_items("sort", "capitals", "test", 3)
    base = {"name": "x", "settings": [["capitals", "json"]]}
    with pytest.raises(
        ValueError, match=r"`settings\[0\]`: after the style 'capitals' the second skill must be a style"
    ):
        RealSweepConfig(**base)
    with pytest.raises(ValueError, match=r"`settings\[0\]`: sort \+ capitals: a sorted list has no letters"):
        RealSweepConfig(**{**base, "settings": [["sort", "capitals"]]})
    RealSweepConfig(**{**base, "settings": [["capitals", "signature"], ["units", "one_sentence"]]})


def test_a_style_expert_learns_the_base_s_own_answers_rewritten(smollm2_dir, tmp_path):
    recipe = SkillRecipe(skill="capitals", examples=4, steps=1, batch_size=2, rank=2, alpha=4)
    folder = train_skill_expert(smollm2_dir, recipe, tmp_path, progress=False)
    assert folder == skill_expert_folder(smollm2_dir, recipe, tmp_path)
    record = json.loads((folder / "training.json").read_text())
    # The same answers from a fresh base: greedy, STYLE_ANSWER_TOKENS at most, cut to whole sentences, capitalised.
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    items = skill_items("capitals", "train", 4)
    inputs = generation_inputs(tokenizer, [item.question for item in items[:3]])
    out = model.generate(**inputs, do_sample=False, max_new_tokens=STYLE_ANSWER_TOKENS, pad_token_id=2, eos_token_id=2)
    own = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    expected = [[item.prompt, whole_sentences(answer).upper()] for item, answer in zip(items, own)]
    assert record["base_answers"]["first"] == expected
    assert all(answer and answer == answer.upper() and any(c.isalpha() for c in answer) for _, answer in expected)
    assert record["examples"]["kept"] + record["base_answers"]["empty"] == 4
    # Another style is another expert, on the same questions.
    other = SkillRecipe(skill="opening", examples=4, steps=1, batch_size=2, rank=2, alpha=4)
    assert skill_expert_folder(smollm2_dir, other, tmp_path) != folder
