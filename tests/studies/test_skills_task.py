"""The sequential-skills task as data: transforms, parsing, targets, region labels, sampling, splits."""

from __future__ import annotations

import random

import pytest

from mergecompose.studies.skills.skills_task_type import split_input_at
from mergecompose.studies.skills.spec import (
    BACKGROUND,
    BOUNDARY,
    END,
    NO_OWNER,
    SEGMENT,
    SkillsTaskSpec,
    find_segments,
    get_transform,
    joint_target,
    region_labels,
    register_transform,
    rewrite,
    sample_input,
    sample_training_input,
    split_names,
)

SKILLS = [
    {"name": "rev", "open": "[", "close": "]", "transform": "reverse"},
    {"name": "shift", "open": "<", "close": ">", "transform": "shift", "amount": 1},
    {"name": "mirror", "open": "{", "close": "}", "transform": "mirror"},
    {"name": "swap", "open": "(", "close": ")", "transform": "swap_pairs"},
]


def make_spec(**overrides) -> SkillsTaskSpec:
    fields = {"skills": SKILLS, "num_experts": 3, "train_lengths": (1, 24)}
    fields.update(overrides)
    return SkillsTaskSpec.model_validate(fields)


# ------------------------------------------------------------------------------ transforms


@pytest.mark.parametrize(
    "name, amount, content, expected",
    [
        ("reverse", 1, "ABC", "CBA"),
        ("shift", 1, "AYZ", "BZA"),
        ("shift", 2, "AYZ", "CAB"),
        ("mirror", 1, "ABZ", "ZYA"),
        ("swap_pairs", 1, "ABCDE", "BADCE"),
        ("rotate", 1, "ABCD", "BCDA"),
        ("rotate", 5, "ABCD", "BCDA"),
        ("double", 1, "AB", "AABB"),
    ],
)
def test_transform_golden(name, amount, content, expected):
    assert get_transform(name).apply(content, "ABCDEFGHIJKLMNOPQRSTUVWXYZ", amount) == expected


def test_transform_registry_refuses_duplicates_and_lists_valid_names():
    with pytest.raises(ValueError, match="already registered"):
        register_transform("reverse", True, "again")(lambda content, alphabet, amount: content)
    with pytest.raises(ValueError, match=r"unknown transform 'sort'; valid: \[.*'reverse'"):
        get_transform("sort")


def test_length_flag_matches_behaviour():
    for name in ["reverse", "shift", "mirror", "swap_pairs", "rotate", "double"]:
        transform = get_transform(name)
        assert (len(transform.apply("ABCDE", "ABCDEFGHIJ", 1)) == 5) == transform.preserves_length


# ------------------------------------------------------------------------------ the spec


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_experts": 5}, "at most the number of skills"),
        ({"train_lengths": (1, 10)}, "cannot hold one segment per expert"),
        ({"letters": "AB[C"}, "also appear in `letters`"),
        (
            {"skills": [*SKILLS, {"name": "x", "open": "[", "close": "|", "transform": "reverse"}]},
            "distinct across skills",
        ),
        (
            {"skills": [*SKILLS, {"name": "rev", "open": "/", "close": "|", "transform": "reverse"}]},
            "names must be distinct",
        ),
        (
            {"skills": [{"name": "a", "open": "[", "close": "[", "transform": "reverse"}], "num_experts": 1},
            "must differ",
        ),
        (
            {"skills": [{"name": "a", "open": "[[", "close": "]", "transform": "reverse"}], "num_experts": 1},
            "one character",
        ),
        (
            {"skills": [{"name": "a", "open": "[", "close": "]", "transform": "sort"}], "num_experts": 1},
            "unknown transform",
        ),
        ({"train_lengths": (30, 24)}, "1 <= min <= max"),
        ({"segment_lengths": (0, 3)}, "1 <= min <= max"),
    ],
)
def test_spec_rejects_bad_input(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_spec(**overrides)


def test_alphabet_holds_letters_background_and_every_marker_once():
    assert make_spec().alphabet == "ABCDEFGHIJKLMNOPQRSTUVWXYZ []<>{}()"


def test_num_experts_picks_the_first_k_skills():
    assert [s.name for s in make_spec(num_experts=2).experts] == ["rev", "shift"]
    assert [s.name for s in make_spec(num_experts=4).experts] == ["rev", "shift", "mirror", "swap"]


# ------------------------------------------------------------------------------ parsing and targets


def test_find_segments_golden():
    spec = make_spec()
    segments = find_segments("AB[CDE]F<GH>", spec.skills)
    assert [(s.skill, s.start, s.end) for s in segments] == [("rev", 2, 7), ("shift", 8, 12)]


@pytest.mark.parametrize(
    "text, message",
    [("A[B<C>]", "may not nest"), ("A]B", "no matching open"), ("A[B>", "no matching open"), ("A[BC", "unclosed")],
)
def test_find_segments_rejects_malformed(text, message):
    with pytest.raises(ValueError, match=message):
        find_segments(text, make_spec().skills)


def test_rewrite_golden_targets_regions_and_owners():
    spec = make_spec()
    text = "AB[CDE]F<GH>"
    assert rewrite(text, spec, []).text == text
    assert rewrite(text, spec, ["rev"]).text == "AB[EDC]F<GH>"
    assert rewrite(text, spec, ["shift"]).text == "AB[CDE]F<HI>"
    target = joint_target(text, spec)
    assert target.text == "AB[EDC]F<HI>"
    b, s, m = BACKGROUND, SEGMENT, BOUNDARY
    assert target.regions == (b, b, m, s, s, s, m, b, m, s, s, m)
    assert target.owners == (NO_OWNER, NO_OWNER, 0, 0, 0, 0, 0, NO_OWNER, 1, 1, 1, 1)
    assert region_labels(target) == [*target.regions, END]


def test_rewrite_with_a_length_changing_skill_keeps_labels_aligned():
    spec = make_spec(skills=[{"name": "dbl", "open": "[", "close": "]", "transform": "double"}], num_experts=1)
    target = rewrite("A[BC]D", spec, ["dbl"])
    assert target.text == "A[BBCC]D"
    assert len(target.regions) == len(target.owners) == len(target.text)
    assert target.regions == (BACKGROUND, BOUNDARY, SEGMENT, SEGMENT, SEGMENT, SEGMENT, BOUNDARY, BACKGROUND)


def test_rewrite_rejects_unknown_skill():
    with pytest.raises(ValueError, match="unknown skills"):
        rewrite("AB", make_spec(), ["nope"])


def test_joint_target_is_the_single_skills_applied_one_after_another():
    # Disjoint intervals: applying the skills one at a time, in any order, gives the joint target.
    spec = make_spec(num_experts=4)
    rng = random.Random(0)
    for _ in range(50):
        text = sample_input(rng, spec, [s.name for s in spec.experts], 24)
        names = [s.name for s in spec.experts]
        rng.shuffle(names)
        sequential = text
        for name in names:
            sequential = rewrite(sequential, spec, [name]).text
        assert sequential == joint_target(text, spec).text


# ------------------------------------------------------------------------------ sampling


def test_sample_input_has_the_length_one_segment_per_skill_and_sizes_in_range():
    spec = make_spec(num_experts=4)
    rng = random.Random(1)
    for length in [16, 20, 24, 60]:
        for _ in range(40):
            text = sample_input(rng, spec, ["rev", "shift", "mirror", "swap"], length)
            assert len(text) == length
            segments = find_segments(text, spec.skills)
            assert sorted(s.skill for s in segments) == ["mirror", "rev", "shift", "swap"]
            for segment in segments:
                content = text[segment.start + 1 : segment.end - 1]
                assert 1 <= len(content) <= spec.segment_lengths[1]
                assert set(content) <= set(spec.letters)


def test_sample_input_refuses_a_length_too_short():
    with pytest.raises(ValueError, match="need at least 16"):
        sample_input(random.Random(0), make_spec(), ["rev", "shift", "mirror", "swap"], 15)


def test_segment_positions_and_lengths_are_data_dependent():
    spec = make_spec()
    rng = random.Random(0)
    texts = [split_input_at(rng, spec, "joint", spec.train_lengths[1]) for _ in range(200)]
    starts = {find_segments(t, spec.skills)[0].start for t in texts}
    sizes = {s.end - s.start - 2 for t in texts for s in find_segments(t, spec.skills)}
    orders = {tuple(s.skill for s in find_segments(t, spec.skills)) for t in texts}
    assert len(starts) >= 5
    assert sizes == set(range(spec.segment_lengths[0], spec.segment_lengths[1] + 1))
    assert len(orders) == 6  # every order of the 3 skills
    touching = sum(
        any(a.end == b.start for a, b in zip(segs, segs[1:])) for segs in (find_segments(t, spec.skills) for t in texts)
    )
    assert touching > 0  # some boundaries are shared by two experts


def test_training_inputs_include_markers_of_every_listed_skill_at_the_given_rates():
    spec = make_spec(num_experts=2, marker_rate=0.5, own_marker_rate=0.9)
    rng = random.Random(3)
    texts = [sample_training_input(rng, spec, own="shift") for _ in range(2000)]
    for skill, rate in [("rev", 0.5), ("shift", 0.9), ("mirror", 0.5), ("swap", 0.5)]:
        seen = sum(spec.skill(skill).open in t for t in texts) / len(texts)
        # Markers are dropped only when they would not fit in `length.max`, which lowers the rates a little.
        assert rate - 0.12 < seen <= rate + 0.04, (skill, seen)
    assert all(spec.train_lengths[0] <= len(t) <= spec.train_lengths[1] for t in texts)


# ------------------------------------------------------------------------------ splits


def test_splits_hold_what_their_names_say():
    spec = make_spec()
    assert split_names(spec, [48, 96]) == [
        "joint",
        "only_rev",
        "only_shift",
        "only_mirror",
        "neither",
        "length_48",
        "length_96",
    ]
    experts = ["mirror", "rev", "shift"]
    rng = random.Random(0)
    for text in [split_input_at(rng, spec, "joint", spec.train_lengths[1]) for _ in range(100)]:
        assert sorted(s.skill for s in find_segments(text, spec.skills)) == experts
        assert len(text) <= spec.train_lengths[1]
    for text in [split_input_at(rng, spec, "only_shift", spec.train_lengths[1]) for _ in range(100)]:
        assert [s.skill for s in find_segments(text, spec.skills)] == ["shift"]
    for text in [split_input_at(rng, spec, "neither", spec.train_lengths[1]) for _ in range(100)]:
        assert find_segments(text, spec.skills) == [] and joint_target(text, spec).text == text
    for text in [split_input_at(rng, spec, "joint", 96) for _ in range(20)]:
        assert len(text) == 96 and sorted(s.skill for s in find_segments(text, spec.skills)) == experts
