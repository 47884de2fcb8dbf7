"""A request's experts and weights (`vllm_xargs`): the parsing and the one-line errors (integrations/vllm/choice.py)."""

from __future__ import annotations

import math

import pytest

from mergecompose.composition.rule import MAX_ABS_WEIGHT
from mergecompose.integrations.vllm.choice import (
    MAX_QUOTED_CHARS,
    expert_name_problem,
    near_miss,
    parse_expert_choice,
    quote,
)

NAMES = ("math", "code", "chat")


@pytest.mark.parametrize(
    ("extra_args", "weights"),
    [
        (None, None),
        ({}, None),
        ({"unrelated": 3}, None),
        ({"experts": ""}, [0.0, 0.0, 0.0]),
        ({"experts": []}, [0.0, 0.0, 0.0]),
        ({"experts": "code"}, [0.0, 1.0, 0.0]),
        ({"experts": "chat, math", "weights": "0.25, 2"}, [2.0, 0.0, 0.25]),
        ({"experts": ["math", "code"], "weights": [1, 0.5]}, [1.0, 0.5, 0.0]),
        ({"experts": "code", "weights": 0.5}, [0.0, 0.5, 0.0]),
        ({"experts": "code", "weights": "-0.5"}, [0.0, -0.5, 0.0]),
    ],
)
def test_a_choice_gives_every_expert_its_weight(extra_args, weights):
    assert parse_expert_choice(extra_args, NAMES) == weights


@pytest.mark.parametrize(
    ("extra_args", "message"),
    [
        ({"experts": "maths"}, "`experts` names unknown expert 'maths'; this server's experts are math, code, chat"),
        ({"experts": "math,,code"}, "`experts` 'math,,code' holds '', which is not an expert name"),
        ({"experts": 3}, "`experts` 3 is a int: give expert names as strings"),
        ({"experts": ["math", 2]}, "holds 2, which is not an expert name"),
        ({"experts": "math,math"}, "`experts` names 'math' more than once"),
        ({"weights": "1"}, "`weights` '1' was given without `experts`"),
        ({"experts": "math,code", "weights": "1"}, "`weights` '1' holds 1 weights for the 2 experts"),
        ({"experts": "math", "weights": "nan"}, "`weights` 'nan' is not a number: each weight must be a finite number"),
        ({"experts": "math", "weights": [math.inf]}, "holds inf, which is not finite: each weight must be a finite"),
        ({"experts": "math", "weights": "-inf"}, "`weights` '-inf' is not a number"),
        ({"experts": "math", "weights": "1e400"}, "`weights` '1e400' is not finite"),
        ({"experts": "math", "weights": "lots"}, "`weights` 'lots' is not a number"),
        ({"experts": "math", "weights": [True]}, "`weights` [True] holds True, which is a boolean"),
    ],
)
def test_a_bad_choice_is_one_line_naming_the_value(extra_args, message):
    with pytest.raises(ValueError) as error:
        parse_expert_choice(extra_args, NAMES)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("key", ["expert", "Experts", "EXPERTS", "exprets", "exerts", "experts_", "Expert"])
def test_a_near_miss_of_experts_is_refused_naming_the_key_meant(key):
    with pytest.raises(ValueError, match=rf"^`vllm_xargs` key '{key}' is a near miss of `experts`: spell it `experts`"):
        parse_expert_choice({key: "math"}, NAMES)


@pytest.mark.parametrize("key", ["weight", "Weights", "WEIGHTS", "wieghts", "weihgts", "wights", "Weight"])
def test_a_near_miss_of_weights_is_refused_even_beside_experts(key):
    with pytest.raises(ValueError, match=rf"^`vllm_xargs` key '{key}' is a near miss of `weights`: spell it `weights`"):
        parse_expert_choice({"experts": "math", key: "2"}, NAMES)


@pytest.mark.parametrize("key", ["session_id", "kv_transfer_params", "diffusion_max_steps", "temperature", "exp", "w"])
def test_keys_far_from_experts_and_weights_pass_through_to_other_processors(key):
    assert parse_expert_choice({key: "math"}, NAMES) is None
    assert parse_expert_choice({key: [1], "experts": "code"}, NAMES) == [0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    ("key", "meant", "near"),
    [
        ("experts", "experts", True),
        ("expert", "experts", True),  # the singular
        ("xeperts", "experts", True),  # one swap of neighbours
        ("exprest", "experts", True),  # two swaps
        ("xpertz", "experts", True),  # a deletion and a substitution
        ("expertsss", "experts", True),
        ("exp", "experts", False),
        ("expertssss", "experts", False),
        ("weights", "experts", False),
        ("heights", "weights", True),  # one edit: refused, though a word of its own
        ("height", "weights", True),
        ("hight", "weights", False),
    ],
)
def test_near_miss_is_case_singular_or_two_edits(key, meant, near):
    assert near_miss(key, meant) is near


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ("1_0", "`weights` '1_0' is not a number"),  # float() reads 10
        ("0x10", "`weights` '0x10' is not a number"),
        ("١", "`weights` '١' is not a number"),  # an Arabic-Indic digit, which float() reads
        ("infinity", "`weights` 'infinity' is not a number"),
        (True, "`weights` True is a boolean"),
        (False, "`weights` False is a boolean"),
        pytest.param(10**400, "`weights` <integer of about 401 digits> is an integer beyond float range", id="1e400"),
        pytest.param(
            -(10**5000), "`weights` <integer of about 5001 digits> is an integer beyond float range", id="-1e5000"
        ),  # past the 4300 digits that str() of an int may print
        (None, "`weights` None is not a number"),
        ({"math": 1}, "`weights` {'math': 1} is not a number"),
        ([[1.0]], "`weights` [[1.0]] holds [1.0], which is not a number"),
        ([{"w": 1}], "`weights` [{'w': 1}] holds {'w': 1}, which is not a number"),
        (100.5, "`weights` 100.5 is beyond the bound |w| <= 100"),
        ("-1e3", "`weights` '-1e3' is beyond the bound |w| <= 100"),
        (10**19, "`weights` 10000000000000000000 is beyond the bound"),
    ],
)
def test_a_weight_is_a_json_number_or_a_strict_decimal_string_within_the_bound(weights, message):
    with pytest.raises(ValueError) as error:
        parse_expert_choice({"experts": "math", "weights": weights}, NAMES)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    assert f"in [-{MAX_ABS_WEIGHT:g}, {MAX_ABS_WEIGHT:g}]" in str(error.value)


@pytest.mark.parametrize(
    ("weights", "expected"),
    [(100, 100.0), (-100.0, -100.0), ("+.5", 0.5), (" 2. ", 2.0), ("1E-2", 0.01), (0, 0.0), (2**63, None)],
)
def test_the_bound_is_inclusive_and_decimal_forms_are_read(weights, expected):
    if expected is None:
        with pytest.raises(ValueError, match="beyond the bound"):
            parse_expert_choice({"experts": "code", "weights": weights}, NAMES)
    else:
        assert parse_expert_choice({"experts": "code", "weights": weights}, NAMES) == [0.0, expected, 0.0]


@pytest.mark.parametrize(
    ("experts", "message"),
    [
        ({"math": 1}, "`experts` {'math': 1} is a dict: give expert names as strings"),
        ([["math"]], "`experts` [['math']] holds ['math'], which is not an expert name"),
        (None, "`experts` None is a NoneType"),
        (True, "`experts` True is a bool"),
        (["math", None], "`experts` ['math', None] holds None, which is not an expert name"),
    ],
)
def test_names_are_strings_only(experts, message):
    with pytest.raises(ValueError) as error:
        parse_expert_choice({"experts": experts}, NAMES)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_long_value_is_quoted_cut_short():
    """Half a megabyte sent is not echoed: the value is quoted to `MAX_QUOTED_CHARS`, ending in "…"."""
    for extra_args in (
        {"experts": "math", "weights": [0.5] * 100_000},
        {"experts": ["x" * 1000] * 500},
        {"experts": "math,code", "weights": "1," + "9" * 500_000},
        {"experts": list(range(100_000))},
    ):
        with pytest.raises(ValueError) as error:
            parse_expert_choice(extra_args, NAMES)
        message = str(error.value)
        assert len(message) < 400 and "\n" not in message and "…" in message, message


@pytest.mark.parametrize(
    ("value", "quoted"),
    [
        ("a" * 200, "'" + "a" * 78 + "…"),
        ([1] * 100, "[" + "1, " * 25 + "1, …"),
        ({"k": [None, True]}, "{'k': [None, True]}"),
        ("line\nbreak", "'line\\nbreak'"),
        (10**70, "1" + "0" * 70),
        pytest.param(10**100, "<integer of about 101 digits>", id="1e100"),  # not printed
        (object(), "<object>"),
    ],
)
def test_quote_is_one_bounded_line(value, quoted):
    assert quote(value) == quoted and len(quote(value)) <= MAX_QUOTED_CHARS


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("math", None),
        ("two words", None),
        ("a,b", "holds a comma"),
        (" math", "has leading or trailing space"),
        ("math\t", "has leading or trailing space"),
        ("", "is empty or blank"),
        ("   ", "is empty or blank"),
        (3, "is a int, not a string"),
    ],
)
def test_an_expert_name_must_be_one_a_request_can_give(name, problem):
    got = expert_name_problem(name)
    assert got is None if problem is None else problem in got


def test_prompt_logprobs_with_own_experts_are_refused():
    with pytest.raises(ValueError, match="prompt log-probs are composed with the server's own weights"):
        parse_expert_choice({"experts": "math"}, NAMES, prompt_logprobs=0)
    assert parse_expert_choice({}, NAMES, prompt_logprobs=0) is None  # the folder's weights: allowed


@pytest.mark.parametrize("key", ["remedy", "remedies", "Remedies"])
def test_a_request_for_a_remedy_is_refused_in_one_line(key):
    """The composite applies the plain rule: a request asking for a remedy is refused, not served without it."""
    extra_args = {"experts": "math", key: "{class: my_package.remedies:Temper}"}
    with pytest.raises(ValueError, match=rf"^`vllm_xargs` key '{key}': the vLLM composite .* supports no remedy; "):
        parse_expert_choice(extra_args, NAMES)
