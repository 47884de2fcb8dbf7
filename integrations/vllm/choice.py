"""A request's experts and weights: the `vllm_xargs` of one request to a composite model served by vLLM.

A request to `vllm serve` of a composite folder (`mergecompose vllm-model`) may choose its own composition
through the OpenAI server's `vllm_xargs` (vLLM's `SamplingParams.extra_args`):

* `experts`: the experts to compose, by the folder's names (`--names`), comma-separated (`"math,code"`) or as
  a list of strings (`["math", "code"]`); `""` (or `[]`) for the base alone;
* `weights`: one exponent `w_i` per expert named, in the same order, comma-separated (`"1.0,0.5"`), a list
  (`[1.0, 0.5]`) or one number (one expert); default 1.0 each, the rule's default. A weight is a JSON number
  (never a boolean) or a decimal string (`"0.5"`, `"-1e-2"`: no `_`, hex, `inf` or `nan`), finite, with
  |w_i| <= `MAX_ABS_WEIGHT` (the rule's bound, `mergecompose.composition.rule`). A negative weight is allowed:
  it moves the distribution away from that expert, relative to the base (`w_i (log p_i − log p_b)`, `w_i < 0`).

Experts the request does not name get weight 0; a request that names nothing gets the folder's own weights.
`extra_args` is shared with other logits processors, so other keys pass through, except near misses of
`experts` and `weights` (another case, the singular, or at most two edits: `"expert"`, `"wieghts"`), which are
refused rather than silently serving the folder's composition.

This module does not import vLLM: it is the parsing and the checks, each error one line naming the key, the value
(quoted, cut to `MAX_QUOTED_CHARS`) and what is allowed (vLLM answers it with HTTP 400).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

from mergecompose.composition.rule import MAX_ABS_WEIGHT

EXPERTS_KEY = "experts"
WEIGHTS_KEY = "weights"
# The composite applies the plain rule only: a request that asks for a remedy is refused, not served without it.
REMEDY_KEYS = ("remedy", "remedies")
# A value is quoted in an error to at most this many characters: a request may send half a megabyte.
MAX_QUOTED_CHARS = 80
# A weight given as a string: a plain decimal or float literal. Stricter than float(), which also reads "1_0",
# "inf", "nan", non-ASCII digits and surrounding whitespace of any kind; here only spaces may surround it.
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_WEIGHT_RULE = (
    f"each weight must be a finite number in [-{MAX_ABS_WEIGHT:g}, {MAX_ABS_WEIGHT:g}], a JSON number (not a "
    'boolean) or a decimal string such as "0.5" or "-1e-2"'
)
_LOG10_2 = math.log10(2)  # an integer's digits are about bit_length * log10(2)
_NAMES_RULE = 'give expert names as strings, comma-separated ("a,b") or a list (["a", "b"])'


def parse_expert_choice(
    extra_args: Mapping[object, object] | None, names: Sequence[str], *, prompt_logprobs: int | None = None
) -> list[float] | None:
    """The request's weight of every expert of the folder (in the folder's order, 0 where not named), or None
    where it names nothing (the folder's own weights).

    Raises ValueError, one line, for a near miss of `experts` or `weights` among the keys, an unknown or repeated
    expert, a name that is not a string, weights without experts or of another count, a weight that is not a
    number of the allowed kinds or lies beyond the bound, and a request that asks for prompt log-probs with its own
    experts (prompt log-probs are composed with the folder's weights)."""
    extra_args = extra_args or {}
    check_keys(extra_args)
    if EXPERTS_KEY not in extra_args:
        if WEIGHTS_KEY in extra_args:
            raise ValueError(
                f"`{WEIGHTS_KEY}` {quote(extra_args[WEIGHTS_KEY])} was given without `{EXPERTS_KEY}`: name the "
                f"experts the weights are for (this server's experts: {', '.join(names)})"
            )
        return None
    chosen = _chosen_names(extra_args[EXPERTS_KEY], names)
    if WEIGHTS_KEY in extra_args:
        weights = _weights(extra_args[WEIGHTS_KEY])
        if len(weights) != len(chosen):
            raise ValueError(
                f"`{WEIGHTS_KEY}` {quote(extra_args[WEIGHTS_KEY])} holds {len(weights)} weights for the "
                f"{len(chosen)} experts named in `{EXPERTS_KEY}`: give one weight per expert, in the same order"
            )
    else:
        weights = [1.0] * len(chosen)
    if prompt_logprobs is not None:
        raise ValueError(
            f"prompt log-probs are composed with the server's own weights; a request with `{EXPERTS_KEY}` cannot "
            "ask for them (`prompt_logprobs`, or `echo` with `logprobs`): send it without one or the other"
        )
    by_name = dict(zip(chosen, weights))
    return [by_name.get(name, 0.0) for name in names]


def check_keys(extra_args: Mapping[object, object]) -> None:
    """Refuse a key that is a near miss of `experts` or `weights` (`near_miss`): a request that misspells one would
    otherwise be served with the folder's composition. Keys far from both belong to other processors and pass. A
    remedy (`remedy`, `remedies`) is refused: the composite supports none."""
    for key in extra_args:
        if isinstance(key, str) and key.lower() in REMEDY_KEYS:
            raise ValueError(
                f"`vllm_xargs` key {quote(key)}: the vLLM composite applies the plain rule and supports no remedy; "
                "compose with remedies through `ComposedLM`, `mergecompose generate --remedy` or lm-eval's "
                "`--model composed`"
            )
        for meant in (EXPERTS_KEY, WEIGHTS_KEY):
            if isinstance(key, str) and key not in (EXPERTS_KEY, WEIGHTS_KEY) and near_miss(key, meant):
                raise ValueError(
                    f"`vllm_xargs` key {quote(key)} is a near miss of `{meant}`: spell it `{meant}` (keys far from "
                    f"`{EXPERTS_KEY}` and `{WEIGHTS_KEY}` pass through to other logits processors)"
                )


def near_miss(key: str, meant: str) -> bool:
    """Whether `key` looks like a misspelling of `meant`: the same word up to case, its singular, or at most two
    edits away, ignoring case (`_edit_distance`: insertions, deletions, substitutions, swaps of neighbours)."""
    folded = key.lower()
    if folded in (meant, meant.removesuffix("s")):
        return True
    return abs(len(folded) - len(meant)) <= 2 and _edit_distance(folded, meant) <= 2


def _edit_distance(first: str, second: str) -> int:
    """The optimal-string-alignment distance (restricted Damerau-Levenshtein): Levenshtein's insertions, deletions
    and substitutions, plus a swap of two neighbouring characters, each costing 1."""
    before: list[int] = []  # the row two above, for swaps
    above = list(range(len(second) + 1))
    for i, a in enumerate(first, 1):
        row = [i]
        for j, b in enumerate(second, 1):
            cost = min(above[j] + 1, row[j - 1] + 1, above[j - 1] + (a != b))
            if i > 1 and j > 1 and a == second[j - 2] and first[i - 2] == b:
                cost = min(cost, before[j - 2] + 1)
            row.append(cost)
        before, above = above, row
    return above[-1]


def expert_name_problem(name: object) -> str | None:
    """Why `name` cannot be an expert's name that a request gives in `experts` (None if it can): it must be a
    non-empty string without a comma (the separator of `"a,b"`) or leading or trailing space (stripped there)."""
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a string"
    if not name.strip():
        return "is empty or blank"
    if "," in name:
        return 'holds a comma, which separates the names of `"experts": "a,b"`'
    if name != name.strip():
        return "has leading or trailing space, which a request's names are stripped of"
    return None


def quote(value: object, limit: int = MAX_QUOTED_CHARS) -> str:
    """`repr(value)` on one line, cut to `limit` characters ("…" at the cut) without rendering the rest."""
    text = _bounded_repr(value, limit + 1)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _bounded_repr(value: object, budget: int) -> str:
    """repr of a JSON-like value, rendered only until it is `budget` characters long (other types by their name)."""
    if isinstance(value, str):
        return repr(value[:budget])
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() * _LOG10_2 >= budget:
        return f"<integer of about {int(value.bit_length() * _LOG10_2) + 1} digits>"  # not printed: it may be huge
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, dict):
        return _bounded_join("{}", value.items(), budget, _bounded_pair)
    if isinstance(value, (list, tuple)):
        return _bounded_join("()" if isinstance(value, tuple) else "[]", value, budget, _bounded_repr)
    return f"<{type(value).__name__}>"


def _bounded_pair(pair: tuple[object, object], budget: int) -> str:
    return f"{_bounded_repr(pair[0], budget)}: {_bounded_repr(pair[1], budget)}"


def _bounded_join(brackets: str, items, budget: int, render) -> str:
    """`brackets[0] item, item, ... brackets[1]`, stopping once `budget` characters are written."""
    text = brackets[0]
    for index, item in enumerate(items):
        if len(text) >= budget:
            break
        text += (", " if index else "") + render(item, budget - len(text))
    return text + brackets[1]


def _chosen_names(value: object, names: Sequence[str]) -> list[str]:
    """The experts a request names, each one of the folder's `names`, each once."""
    chosen = _names(value)
    for name in chosen:
        if name not in names:
            raise ValueError(
                f"`{EXPERTS_KEY}` names unknown expert {quote(name)}; this server's experts are {', '.join(names)} "
                '("" for the base alone)'
            )
    seen: set[str] = set()
    for name in chosen:
        if name in seen:
            raise ValueError(f"`{EXPERTS_KEY}` names {quote(name)} more than once: name each expert once")
        seen.add(name)
    return chosen


def _names(value: object) -> list[str]:
    if isinstance(value, str):
        items: list[object] = [] if not value.strip() else list(value.split(","))
    elif isinstance(value, list):
        items = list(value)
    else:
        raise ValueError(f"`{EXPERTS_KEY}` {quote(value)} is a {type(value).__name__}: {_NAMES_RULE}")
    names = []
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise ValueError(
                f"`{EXPERTS_KEY}` {quote(value)} holds {quote(item, 30)}, which is not an expert name: {_NAMES_RULE}"
            )
        names.append(item.strip())
    return names


def _weights(value: object) -> list[float]:
    """The weights a request gives, in its order: each checked by `_weight`."""
    if isinstance(value, str):
        items: list[object] = [] if not value.strip() else list(value.split(","))
    elif isinstance(value, list):
        items = list(value)
    else:
        items = [value]
    one = len(items) == 1 and not isinstance(value, list)  # the value is the weight: quote it once
    given = f"`{WEIGHTS_KEY}` {quote(value)}"
    return [_weight(item, given if one else f"{given} holds {quote(item, 30)}, which") for item in items]


def _weight(item: object, subject: str) -> float:
    """One weight: an int or float (not a bool), or a string matching `_DECIMAL`; finite, |w| <= MAX_ABS_WEIGHT.
    `subject` starts the error: "`weights` VALUE" or "`weights` VALUE holds ITEM, which"."""
    if isinstance(item, str) and _DECIMAL.fullmatch(item.strip(" ")):
        weight = float(item)
    elif isinstance(item, (int, float)) and not isinstance(item, bool):
        try:
            weight = float(item)
        except OverflowError:
            raise ValueError(f"{subject} is an integer beyond float range: {_WEIGHT_RULE}") from None
    else:
        raise ValueError(f"{subject} is {'a boolean' if isinstance(item, bool) else 'not a number'}: {_WEIGHT_RULE}")
    if not math.isfinite(weight):
        raise ValueError(f"{subject} is not finite: {_WEIGHT_RULE}")
    if abs(weight) > MAX_ABS_WEIGHT:
        raise ValueError(f"{subject} is beyond the bound |w| <= {MAX_ABS_WEIGHT:g}: {_WEIGHT_RULE}")
    return weight
