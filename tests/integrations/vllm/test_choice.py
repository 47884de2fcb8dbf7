"""A request's experts and weights (`vllm_xargs`): the parsing and the one-line errors (integrations/vllm/choice.py)."""

from __future__ import annotations

import math

import pytest

from mergecompose.integrations.vllm.choice import parse_expert_choice

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
        ({"experts": 3}, "`experts` must be expert names"),
        ({"experts": ["math", 2]}, "holds 2, which is not an expert name"),
        ({"experts": "math,math"}, "`experts` names 'math' more than once"),
        ({"weights": "1"}, "`weights` '1' was given without `experts`"),
        ({"experts": "math,code", "weights": "1"}, "`weights` '1' holds 1 weights for the 2 experts"),
        ({"experts": "math", "weights": "nan"}, "`weights` 'nan' holds nan; each weight must be a finite number"),
        ({"experts": "math", "weights": [math.inf]}, "holds inf; each weight must be a finite number"),
        ({"experts": "math", "weights": "-inf"}, "holds -inf"),
        ({"experts": "math", "weights": "lots"}, "`weights` 'lots' holds 'lots', which is not a number"),
        ({"experts": "math", "weights": [True]}, "holds True; each weight must be a finite number"),
    ],
)
def test_a_bad_choice_is_one_line_naming_the_value(extra_args, message):
    with pytest.raises(ValueError) as error:
        parse_expert_choice(extra_args, NAMES)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_prompt_logprobs_with_own_experts_are_refused():
    with pytest.raises(ValueError, match="prompt log-probs are composed with the server's own weights"):
        parse_expert_choice({"experts": "math"}, NAMES, prompt_logprobs=0)
    assert parse_expert_choice({}, NAMES, prompt_logprobs=0) is None  # the folder's weights: allowed
