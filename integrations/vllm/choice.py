"""A request's experts and weights: the `vllm_xargs` of one request to a composite model served by vLLM.

A request to `vllm serve` of a composite folder (`mergecompose vllm-model`) may choose its own composition
through the OpenAI server's `vllm_xargs` (vLLM's `SamplingParams.extra_args`):

* `experts`: the experts to compose, by the folder's names (`--names`), comma-separated (`"math,code"`) or as
  a list (`["math", "code"]`); `""` (or `[]`) for the base alone;
* `weights`: one exponent `w_i` per expert named, in the same order, comma-separated (`"1.0,0.5"`), a list
  (`[1.0, 0.5]`) or one number (one expert); default 1.0 each, the rule's default. A negative weight is allowed,
  as in `mergecompose.composition.rule`: it moves the distribution away from that expert, relative to the base
  (`w_i (log p_i − log p_b)` with `w_i < 0`).

Experts the request does not name get weight 0; a request that names nothing gets the folder's own weights.
This module does not import vLLM: it is the parsing and the checks, each error one line naming the argument,
the value and what is allowed (vLLM answers it with HTTP 400).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

EXPERTS_KEY = "experts"
WEIGHTS_KEY = "weights"


def parse_expert_choice(
    extra_args: Mapping[str, object] | None, names: Sequence[str], *, prompt_logprobs: int | None = None
) -> list[float] | None:
    """The request's weight of every expert of the folder (in the folder's order, 0 where not named), or None
    where it names nothing (the folder's own weights).

    Raises ValueError for an unknown or repeated expert, weights without experts or of another count, a weight
    that is not a finite number, and a request that asks for prompt log-probs with its own experts (prompt
    log-probs are composed with the folder's weights)."""
    extra_args = extra_args or {}
    if EXPERTS_KEY not in extra_args:
        if WEIGHTS_KEY in extra_args:
            raise ValueError(
                f"`{WEIGHTS_KEY}` {extra_args[WEIGHTS_KEY]!r} was given without `{EXPERTS_KEY}`: name the experts "
                f"the weights are for (this server's experts: {', '.join(names)})"
            )
        return None
    chosen = _names(extra_args[EXPERTS_KEY])
    unknown = [name for name in chosen if name not in names]
    if unknown:
        raise ValueError(
            f"`{EXPERTS_KEY}` names unknown expert {unknown[0]!r}; this server's experts are {', '.join(names)} "
            '("" for the base alone)'
        )
    repeated = sorted({name for name in chosen if chosen.count(name) > 1})
    if repeated:
        raise ValueError(f"`{EXPERTS_KEY}` names {repeated[0]!r} more than once; name each expert once")
    if WEIGHTS_KEY in extra_args:
        weights = _weights(extra_args[WEIGHTS_KEY])
        if len(weights) != len(chosen):
            raise ValueError(
                f"`{WEIGHTS_KEY}` {extra_args[WEIGHTS_KEY]!r} holds {len(weights)} weights for the {len(chosen)} "
                f"experts named in `{EXPERTS_KEY}`; give one weight per expert, in the same order"
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


def _names(value: object) -> list[str]:
    if isinstance(value, str):
        items: list[object] = [] if not value.strip() else value.split(",")
    elif isinstance(value, list):
        items = list(value)
    else:
        raise ValueError(f'`{EXPERTS_KEY}` must be expert names, comma-separated ("a,b") or a list, got {value!r}')
    names = []
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise ValueError(f"`{EXPERTS_KEY}` {value!r} holds {item!r}, which is not an expert name")
        names.append(item.strip())
    return names


def _weights(value: object) -> list[float]:
    if isinstance(value, str):
        items: list[object] = [] if not value.strip() else value.split(",")
    elif isinstance(value, list):
        items = list(value)
    else:
        items = [value]
    weights = []
    for item in items:
        if isinstance(item, bool):
            raise ValueError(f"`{WEIGHTS_KEY}` {value!r} holds {item!r}; each weight must be a finite number")
        try:
            weight = float(item.strip() if isinstance(item, str) else item)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError(
                f"`{WEIGHTS_KEY}` {value!r} holds {item!r}, which is not a number; each weight must be a finite number"
            ) from None
        if not math.isfinite(weight):
            raise ValueError(f"`{WEIGHTS_KEY}` {value!r} holds {weight}; each weight must be a finite number")
        weights.append(weight)
    return weights
