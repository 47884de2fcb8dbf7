"""Properties of `parse_expert_choice` (integrations/vllm/choice.py) over arbitrary `extra_args`: every request is
either a valid choice or refused with one short line naming `experts` or `weights`. No vLLM is imported: the
parser runs here as it does in the server's `validate_params` (tests/integrations/vllm/engine/ checks that path)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from mergecompose.composition.rule import MAX_ABS_WEIGHT
from mergecompose.integrations.vllm.choice import near_miss, parse_expert_choice

NAMES = ("math", "code", "chat")
# A refusal quotes at most two values of `MAX_QUOTED_CHARS` and the server's names; this bounds it with room to spare.
MAX_MESSAGE_CHARS = 400

HUGE_INTEGERS = st.sampled_from([10**400, -(10**400), 2**1024, 10**4000, 2**63, -(2**63) - 1])  # printable ints
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | HUGE_INTEGERS
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["1_0", "0x1", "inf", "-nan", " 1.5 ", "1e400", "+.5", "math, code", "", ","])
)
JSON_VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
)
# Values near what a request means, so that valid choices are drawn too.
NAME_VALUES = st.lists(st.sampled_from(NAMES), max_size=4) | st.lists(st.sampled_from(NAMES), max_size=4).map(",".join)
WEIGHT_ITEMS = st.floats(-150, 150) | st.integers(-150, 150) | st.floats(-150, 150).map(repr) | SCALARS
WEIGHT_VALUES = (
    WEIGHT_ITEMS
    | st.lists(WEIGHT_ITEMS, max_size=4)
    | st.lists(st.floats(-150, 150), max_size=4).map(lambda weights: ",".join(map(str, weights)))
)
KEYS = st.sampled_from(["experts", "weights", "expert", "Weights", "wieghts", "session_id"]) | st.text(max_size=9)
EXTRA_ARGS = st.dictionaries(KEYS, JSON_VALUES | NAME_VALUES | WEIGHT_VALUES, max_size=4) | st.fixed_dictionaries(
    {"experts": NAME_VALUES | JSON_VALUES}, optional={"weights": WEIGHT_VALUES | JSON_VALUES}
)


def _check_outcome(extra_args) -> list[float] | None:
    """The parser's result, checked to be a valid choice; a refusal checked to be one short line naming a key."""
    try:
        weights = parse_expert_choice(extra_args, NAMES)
    except ValueError as error:
        message = str(error)
        assert "\n" not in message and "\r" not in message, message
        assert len(message) <= MAX_MESSAGE_CHARS, len(message)
        assert "`experts`" in message or "`weights`" in message, message
        return None
    if weights is not None:
        assert len(weights) == len(NAMES) and all(isinstance(weight, float) for weight in weights)
        assert all(math.isfinite(weight) and abs(weight) <= MAX_ABS_WEIGHT for weight in weights), weights
    else:
        assert "experts" not in extra_args
    return weights


@settings(max_examples=400, deadline=None)
@given(EXTRA_ARGS)
def test_any_extra_args_give_a_valid_choice_or_one_short_line(extra_args):
    _check_outcome(extra_args)


@settings(max_examples=200, deadline=None)
@given(st.permutations(NAMES).flatmap(lambda names: st.tuples(st.integers(0, 3), st.just(names))), st.data())
def test_a_valid_choice_gives_each_named_expert_its_weight(count_and_names, data):
    """The weights come back in the folder's order whatever form they were sent in: numbers, repr strings, a
    comma-separated string; the experts not named get 0."""
    count, order = count_and_names
    chosen = list(order[:count])
    weights = data.draw(st.lists(st.floats(-MAX_ABS_WEIGHT, MAX_ABS_WEIGHT), min_size=count, max_size=count))
    form = data.draw(st.sampled_from(["numbers", "strings", "joined"]))
    sent = {"numbers": weights, "strings": [repr(w) for w in weights], "joined": ",".join(map(repr, weights))}[form]
    got = parse_expert_choice({"experts": ",".join(chosen), "weights": sent}, NAMES)
    assert got == [dict(zip(chosen, weights)).get(name, 0.0) for name in NAMES]


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=12))
def test_a_weight_string_is_read_only_if_it_is_plain_decimal(text):
    """A string weight that is read holds only digits, signs, a point, an exponent and spaces, and reads as float()
    reads it: "1_0", "inf", "nan", hex and other digits are refused."""
    try:
        weights = parse_expert_choice({"experts": "math", "weights": [text]}, NAMES)
    except ValueError as error:
        assert str(error).startswith("`weights` [")
        return
    assert set(text) <= set("0123456789+-.eE ") and weights == [float(text), 0.0, 0.0]


@st.composite
def one_edit(draw, word):
    """`word` with one insertion, deletion, substitution, swap of neighbours, or with its case changed."""
    letters = st.sampled_from("abcdefghijklmnopqrstuvwxyz_")
    index = draw(st.integers(0, len(word) - 1))
    kind = draw(st.sampled_from(["insert", "delete", "substitute", "swap", "case"]))
    if kind == "insert":
        return word[:index] + draw(letters) + word[index:]
    if kind == "delete":
        return word[:index] + word[index + 1 :]
    if kind == "substitute":
        return word[:index] + draw(letters) + word[index + 1 :]
    if kind == "swap" and index < len(word) - 1:
        return word[:index] + word[index + 1] + word[index] + word[index + 2 :]
    return "".join(draw(st.sampled_from([c.lower(), c.upper()])) for c in word)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["experts", "weights"]).flatmap(lambda word: st.tuples(st.just(word), one_edit(word))))
def test_a_key_one_edit_from_experts_or_weights_is_refused_naming_both(word_and_key):
    word, key = word_and_key
    if key in ("experts", "weights"):
        return
    assert near_miss(key, word)
    extra_args = {key: "math"} if word == "experts" else {"experts": "math", key: "1"}
    try:
        parse_expert_choice(extra_args, NAMES)
    except ValueError as error:
        assert str(error).startswith(f"`vllm_xargs` key {key!r} is a near miss of `{word}`: spell it `{word}`")
    else:
        raise AssertionError(f"{key!r} was not refused")
