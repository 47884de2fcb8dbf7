"""A request's `vllm_xargs` on vLLM's own path to admission, without an engine or a server: the OpenAI request model
(`CompletionRequest`), `to_sampling_params`, then vLLM's `validate_logits_processors_parameters`, which runs
`ExpertChoice.validate_params` (integrations/vllm/requests.py) and turns its ValueError into `VLLMValidationError`,
the HTTP 400. The served test (test_vllm_serve.py) sends a few of these to a real server."""

from __future__ import annotations

import math

import pydantic
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from vllm import SamplingParams
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import validate_logits_processors_parameters

from mergecompose.composition.rule import MAX_ABS_WEIGHT
from mergecompose.integrations.vllm.choice import parse_expert_choice
from mergecompose.integrations.vllm.plugin import PROCESSOR, SERVED_EXPERTS
from mergecompose.integrations.vllm.requests import ExpertChoiceV2

NAMES = ["math", "code"]

FLAT = (
    st.booleans()
    | st.integers()
    | st.sampled_from([10**400, 2**64, -(2**63) - 1, 2**63])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.floats(-MAX_ABS_WEIGHT, MAX_ABS_WEIGHT)
    | st.sampled_from(["math", "code", "math,code", "", "1_0", "0.5", " 2 ", "inf"])
)
JSON_VALUES = st.recursive(
    FLAT | st.none(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=2),
)
VALUES = FLAT | st.lists(FLAT, max_size=3) | JSON_VALUES
XARGS = st.dictionaries(st.sampled_from(["experts", "weights", "expert", "Weights", "session_id"]), VALUES)


@pytest.fixture(scope="module", autouse=True)
def served_names():
    """The names `plugin.ComposedConfig` records when the server builds a composite engine's config."""
    before = list(SERVED_EXPERTS)
    SERVED_EXPERTS[:] = NAMES
    yield
    SERVED_EXPERTS[:] = before


def _admit(xargs: dict) -> tuple[str, object]:
    """The stage that refused the request ("request model", "sampling params", "ours") and its error, or
    ("admitted", SamplingParams): what the OpenAI server does with `vllm_xargs` up to admission."""
    try:
        request = CompletionRequest.model_validate({"model": "m", "prompt": "ab", "vllm_xargs": xargs})
    except pydantic.ValidationError as error:
        return "request model", error
    try:
        params = request.to_sampling_params(16, {})
    except VLLMValidationError as error:
        return "sampling params", error
    try:
        validate_logits_processors_parameters([PROCESSOR], params)
    except VLLMValidationError as error:
        return "ours", error
    return "admitted", params


def _as_the_request_model_reads(value):
    """`value` as vLLM's request model hands it on: JSON booleans become 0/1, everything else unchanged."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, list):
        return [_as_the_request_model_reads(item) for item in value]
    return value


def _same(first, second) -> bool:
    """Equal values of equal types (NaN equal to NaN): `1 == True == 1.0` is not enough here."""
    if type(first) is not type(second):
        return False
    if isinstance(first, list):
        return len(first) == len(second) and all(_same(a, b) for a, b in zip(first, second))
    if isinstance(first, float) and math.isnan(first):
        return math.isnan(second)
    return first == second


def _outside_the_request_model(value, nested=False) -> bool:
    """Whether vLLM's `dict[str, str | int | float | list[str | int | float]]` refuses this value."""
    if value is None or isinstance(value, dict):
        return True
    if isinstance(value, list):
        return nested or any(_outside_the_request_model(item, nested=True) for item in value)
    return False


@settings(max_examples=300, deadline=None)
@given(XARGS)
def test_any_vllm_xargs_is_admitted_valid_or_refused_in_one_line_by_us_or_by_vllm_first(xargs):
    stage, outcome = _admit(xargs)
    event(stage)  # `--hypothesis-show-statistics` shows how many examples reached each stage
    if stage == "request model":  # vLLM's own multi-line 400, before any processor
        assert any(_outside_the_request_model(value) for value in xargs.values())
        return
    if stage == "sampling params":  # vLLM's one line: msgpack carries 64-bit integers only
        assert "extra_args integers must be between" in str(outcome)
        return
    assert not any(_outside_the_request_model(value) for value in xargs.values())
    if stage == "ours":
        message = str(outcome)
        assert "\n" not in message and len(message) <= 400 and ("`experts`" in message or "`weights`" in message)
        return
    # Admitted: the parser saw what the request sent, but for booleans, and chose finite bounded weights.
    assert all(_same(outcome.extra_args[key], _as_the_request_model_reads(xargs[key])) for key in xargs)
    weights = parse_expert_choice(outcome.extra_args, NAMES)
    assert weights is None or all(math.isfinite(w) and abs(w) <= MAX_ABS_WEIGHT for w in weights)


def test_a_json_boolean_weight_reaches_the_parser_as_a_number():
    """vLLM's request model reads `true` as 1 (pydantic's lax `int` of `str | int | float`), so the server serves
    `"weights": true` as weight 1: the parser cannot tell. `SamplingParams` built in Python keeps the bool, refused."""
    stage, params = _admit({"experts": "math", "weights": [True]})
    assert stage == "admitted" and params.extra_args == {"experts": "math", "weights": [1]}
    with pytest.raises(VLLMValidationError, match=r"^`weights` \[True\] holds True, which is a boolean"):
        validate_logits_processors_parameters(
            [PROCESSOR], SamplingParams(extra_args={"experts": "math", "weights": [True]})
        )


@pytest.mark.parametrize(
    "xargs", [{"experts": {"math": 1}}, {"experts": [["math"]]}, {"weights": [{"w": 1}]}, {"experts": None}]
)
def test_a_nested_value_is_refused_by_vllms_request_model_before_our_code(xargs):
    """The request model refuses it with pydantic's errors, one per branch of its union: vLLM's multi-line 400.
    Built in Python (`LLM.generate`), the same value reaches our parser, which refuses it in one line."""
    stage, error = _admit(xargs)
    assert stage == "request model" and "vllm_xargs" in str(error) and "\n" in str(error)
    with pytest.raises(VLLMValidationError) as ours:
        validate_logits_processors_parameters([PROCESSOR], SamplingParams(extra_args={"experts": "math", **xargs}))
    assert "\n" not in str(ours.value) and str(ours.value).startswith(("`experts`", "`weights`"))


def test_an_integer_past_64_bits_is_refused_by_sampling_params_before_our_code():
    stage, error = _admit({"experts": "math", "weights": 10**400})
    assert stage == "sampling params" and str(error).startswith("extra_args integers must be between")


@pytest.mark.parametrize(
    ("xargs", "message"),
    [
        ({"expert": "math"}, "`vllm_xargs` key 'expert' is a near miss of `experts`"),
        ({"experts": "math", "weights": "1_0"}, "`weights` '1_0' is not a number"),
        ({"experts": "math", "weights": 2**63}, "`weights` 9223372036854775808 is beyond the bound |w| <= 100"),
        ({"experts": "math", "weights": [0.5] * 10_000}, "`weights` [0.5, 0.5"),
    ],
)
def test_our_refusals_pass_through_vllm_as_one_line(xargs, message):
    stage, error = _admit(xargs)
    assert stage == "ours" and str(error).startswith(message) and "\n" not in str(error) and len(str(error)) < 400


def test_the_v2_processor_refuses_a_misspelt_key_too():
    """Under the V2 model runner a misspelt key would otherwise be served with the folder's weights."""
    with pytest.raises(ValueError, match="`vllm_xargs` key 'wieghts' is a near miss of `weights`"):
        ExpertChoiceV2.validate_params(SamplingParams(extra_args={"wieghts": "1"}))
    ExpertChoiceV2.validate_params(SamplingParams(extra_args={"session_id": "1"}))  # another processor's key
