"""The real settings' skills: held-out templates disjoint from training, splits that share no item, the joint
items, and the scorers on hand-written answers."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from mergecompose.studies.skill_pairs.skill_data import (
    CONTENT_SKILLS,
    FORMAT_SKILLS,
    SIGNATURE,
    SKILLS,
    SkillItem,
    formatted,
    joint_items,
    phrasings,
    skill_items,
)
from mergecompose.studies.skill_pairs.skill_experts import check_expert_bar
from mergecompose.studies.skill_pairs.skill_scoring import score_item


def _template_words(template: str) -> str:
    return template.split("{")[0].strip()


@pytest.mark.parametrize("skill", SKILLS)
def test_held_out_templates_are_disjoint_from_training(skill):
    train, held_out = set(phrasings(skill, "train")), set(phrasings(skill, "test"))
    assert train and held_out and not train & held_out
    assert set(phrasings(skill, "validation")) == held_out
    # Every item says which template made it, and each split's items come from that split's templates only.
    for split, templates in (("train", train), ("validation", held_out), ("test", held_out)):
        items = skill_items(skill, split, 60)
        assert {item.template for item in items} <= templates
        assert len({item.template for item in items}) == len(templates)  # all of them are used
    # No training prompt's instruction reads like a held-out one.
    for item in skill_items(skill, "train", 200):
        assert not any(_template_words(t) and _template_words(t) in item.prompt for t in held_out), item.prompt


@pytest.mark.parametrize("skill", SKILLS)
def test_validation_and_test_share_no_item(skill):
    validation, test = skill_items(skill, "validation", 100), skill_items(skill, "test", 100)
    assert len({item.prompt for item in validation}) == len({item.prompt for item in test}) == 100
    assert not {item.prompt for item in validation} & {item.prompt for item in test}
    assert skill_items(skill, "test", 100) == test  # seeded


@pytest.mark.parametrize("first", CONTENT_SKILLS)
@pytest.mark.parametrize("second", SKILLS)
def test_joint_items_need_both_skills_and_their_references_score_right(first, second):
    if first == second:
        with pytest.raises(ValueError, match="two skills are needed"):
            joint_items(first, second, "test", 5)
        return
    if (first, second) == ("sort", "capitals"):
        with pytest.raises(ValueError, match="has no letters"):
            joint_items(first, second, "test", 5)
        return
    items = joint_items(first, second, "test", 40)
    validation = joint_items(first, second, "validation", 40)
    assert not {item.prompt for item in items} & {item.prompt for item in validation}
    for item in items:
        assert item.skills == (first, second)
        score = score_item(item, item.answer)
        assert score.strict and score.lenient, (item, score)
        assert set(score.parts) == {first, second}
        # An answer with one part only is wrong on the joint item.
        if second in FORMAT_SKILLS:
            assert not score_item(item, item.content[0]).strict
        elif second == "one_sentence":  # a bare content answer is one sentence already
            assert score_item(item, f"{item.content[0]}. And more.").parts["one_sentence"].lenient is False
        else:
            assert not score_item(item, item.content[0]).lenient


def test_the_answers_are_short(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    lengths = [
        len(tokenizer.encode(item.answer, add_special_tokens=False))
        for skill in SKILLS
        for item in skill_items(skill, "test", 50)
    ]
    assert max(lengths) <= 32
    joint = [item for second in SKILLS if second != "units" for item in joint_items("units", second, "test", 20)]
    assert max(len(tokenizer.encode(item.answer, add_special_tokens=False)) for item in joint) <= 32


# ---------------------------------------------------------------------------------------------
# The scorers on hand-written answers


@pytest.mark.parametrize(
    ("skill", "prompt_answer", "output", "strict", "lenient"),
    [
        ("units", "7000 m", "7000 m", True, True),
        ("units", "7000 m", "7,000 meters", False, True),
        ("units", "7000 m", "That is 700 m.", False, False),
        ("dates", "March 4, 2021", "March 4, 2021", True, True),
        ("dates", "March 4, 2021", "It is March 04 2021.", False, True),
        ("dates", "March 4, 2021", "March 14, 2021", False, False),
        ("sort", "3, 7, 19, 42", "3, 7, 19, 42", True, True),
        ("sort", "3, 7, 19, 42", "The order: 3 < 7 < 19 < 42", False, True),
        ("sort", "3, 7, 19, 42", "3, 19, 7, 42", False, False),
    ],
)
def test_content_scores(skill, prompt_answer, output, strict, lenient):
    item = SkillItem("q", prompt_answer, (skill,), (prompt_answer,))
    score = score_item(item, output)
    assert (score.strict, score.lenient) == (strict, lenient)


@pytest.mark.parametrize(
    ("form", "output", "strict", "lenient"),
    [
        ("json", '{"answer": "red"}', True, True),
        ("json", 'Sure: {"answer": "red"}', False, True),
        ("json", '{"answer": "red", "note": "x"}', False, True),
        ("json", '{"colour": "red"}', False, False),
        ("brackets", "[red]", True, True),
        ("brackets", "The answer is [red].", False, True),
        ("brackets", "red", False, False),
        ("signature", f"red\n{SIGNATURE}", True, True),
        ("signature", "red\nBest, SmolLM", False, True),
        ("signature", "red", False, False),
    ],
)
def test_format_scores(form, output, strict, lenient):
    item = SkillItem("q", formatted(form, "red"), (form,), ("red",), form)
    score = score_item(item, output)
    assert (score.strict, score.lenient) == (strict, lenient)


def test_a_joint_answer_is_right_only_when_both_parts_are():
    item = SkillItem("q", formatted("json", "3, 7, 19, 42"), ("sort", "json"), ("3, 7, 19, 42",), "json")
    assert score_item(item, json.dumps({"answer": "3, 7, 19, 42"})).strict
    wrong_content = score_item(item, json.dumps({"answer": "3, 19, 7, 42"}))
    assert not wrong_content.lenient and wrong_content.parts["json"].strict
    wrong_form = score_item(item, "3, 7, 19, 42")
    assert not wrong_form.lenient and wrong_form.parts["sort"].strict is False and wrong_form.parts["sort"].lenient
    sequential = SkillItem("q", "7000 m\nMarch 4, 2021", ("units", "dates"), ("7000 m", "March 4, 2021"))
    assert score_item(sequential, "7000 m\nMarch 4, 2021").strict
    assert not score_item(sequential, "7000 m").lenient
    assert score_item(sequential, "7000 m, and March 4, 2021").lenient


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="`skill` must be one of"):
        skill_items("french", "test", 3)
    with pytest.raises(ValueError, match="`split` must be one of"):
        skill_items("units", "dev", 3)
    with pytest.raises(ValueError, match="the first skill must be a content skill"):
        joint_items("json", "units", "test", 3)
    with pytest.raises(ValueError, match="`output` must be a str"):
        score_item(skill_items("units", "test", 1)[0], None)


@pytest.mark.parametrize(
    ("base", "expert", "real"),
    [
        (0.17, 0.37, True),  # + 20 points exactly
        (0.17, 0.36, False),
        (0.0, 1.0, True),
        (0.80, 0.90, True),  # a high base: 90 % is enough
        (0.80, 0.89, False),
        (0.95, 0.90, True),  # the bar never asks more than 90 %
    ],
)
def test_the_expert_bar(base, expert, real):
    scores = ({"lenient": base, "strict": 0.1}, {"lenient": expert, "strict": 0.05})
    if real:
        check_expert_bar("units", *scores)
    else:
        with pytest.raises(ValueError, match=r"the `units` expert is below its bar: lenient .* \(strict 5\.0%\)"):
            check_expert_bar("units", *scores)
