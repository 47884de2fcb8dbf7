"""The lm-evaluation-harness model `composed`: a `ComposedLM` in front of lm-eval's three request types.

Importing this module registers the model with lm-eval (`register_model("composed")`); it needs
the `lm-eval` extra (`pip install "mergecompose[lm-eval]"`), which `import mergecompose.composition` does not.

    lm_eval --model composed --model_args base=B,experts=E1|E2[,weights=1.0|1.0][,remedies=gate:0.1]
    lm_eval.simple_evaluate(model="composed", model_args={"base": B, "experts": [E1, E2]}, tasks=[...])

`model_args` (lm-eval splits its string form on commas, so lists use `|`):

* `base`: a checkpoint folder or hub id;
* `experts`: full checkpoints or peft adapter folders (told apart as `ComposedLM.from_pretrained`
  does); all adapters share one base copy (`lora_implementation`: "stacked" or "peft");
* `weights`: one exponent per expert (default 1 each);
* `remedies`: `mergecompose.composition.remedies.RemedySettings` as `field:value` pairs joined by `;`, e.g.
  `gate:0.1;termination:base` (the same names as a compare config's `remedies:`);
* `dtype` (default float32), `device` (default cpu), `batch_size` (an integer), `max_batch_size`,
  `max_length`, `chunk_megabytes` (see below).

lm-eval hands them over typed (`weights=0.5` arrives as a float, `batch_size=2` as an int) and adds its
own `batch_size`, `max_batch_size` and `device` (`--batch_size`, `--device`); a value given in
`model_args` wins over lm-eval's. `ComposedModelArgs.parse` checks them all before any model loads:
`base` and `experts` are required, an unknown name is refused with the valid ones, and every error
is a ValueError that names the model_arg, the value and what is allowed.

`HFLM` does batching, request ordering, context truncation and the log-likelihood bookkeeping;
only the two model hooks are replaced. `_model_call` returns the composed log-probs
`log p̂ = log p_b + Σ_i w_i (log p_i − log p_b) − log Z` (lm-eval's own log-softmax of them is a
no-op up to rounding), so `loglikelihood` is the sum of composed log-probs over the continuation
and `loglikelihood_rolling` that over every window. `_model_generate` decodes with
`ComposedLM.generate` (KV caches, left padding, greedy or sampling from the task's `gen_kwargs`),
which stops each row at EOS or at the first of the task's stop strings.

Memory of the log-likelihood path: the k+1 components' float32 log-probs of a chunk of rows are
`(k+1) × rows × T × V × 4` bytes; rows are processed in chunks that keep this under
`chunk_megabytes` (default 1024), and only the composed `(B, T, V)` result of the whole batch is
kept (lm-eval's log-softmax then makes one more). With Gemma-2's vocabulary (256,000), k = 2 and
T = 512 one row costs 1.5 GiB of component log-probs, so a chunk is one row; the composed batch
costs `B × 0.5 GiB`.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own models first: its registry loads them only while empty)
import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.utils import simple_parse_args_string

from mergecompose.composition.model import ComposedLM
from mergecompose.composition.remedies import RemedySettings
from mergecompose.core.precision import DTYPES

_DEVICE = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")
_LORA_IMPLEMENTATIONS = ("stacked", "peft")
_SAMPLING_KWARGS = ("do_sample", "temperature", "top_k", "top_p", "seed")
# What a task's (or the command line's) generation settings may hold: HFLM reads the stop strings and the
# token budget (under any of lm-eval's aliases) itself; the rest reaches `ComposedLM.generate`.
GENERATION_KWARGS = (
    "until",
    "max_gen_toks",
    "max_new_tokens",
    "max_tokens",
    "max_completion_tokens",
    *_SAMPLING_KWARGS,
)
# Every model_arg, with what it allows (the text of an error). lm-eval passes `batch_size`, `max_batch_size`
# and `device` itself (`additional_config`); a value given in model_args wins over lm-eval's.
MODEL_ARGS = {
    "base": "a checkpoint folder or hub id (required)",
    "experts": "checkpoint or peft adapter folders or hub ids separated by '|', or a list (required)",
    "weights": "one number per expert, separated by '|', or a list",
    "remedies": "`field:value` pairs joined by ';' (RemedySettings)",
    "lora_implementation": f"one of {list(_LORA_IMPLEMENTATIONS)}",
    "dtype": f"one of {sorted(DTYPES)}",
    "device": "'cpu', 'cuda', 'cuda:N' or 'mps'",
    "batch_size": "a positive integer",
    "max_batch_size": "a positive integer",
    "max_length": "a positive integer",
    "chunk_megabytes": "a positive integer",
}
_REQUIRED = ("base", "experts")


def split_list(value, name: str) -> list[str]:
    """A `|`-separated string (lm-eval's string `model_args`) or a list, as a list of non-empty strings."""
    if isinstance(value, (list, tuple)):
        items = list(value)
    elif isinstance(value, (str, os.PathLike)):
        items = os.fspath(value).split("|")
    else:
        raise ValueError(f"model_arg `{name}` must list one or more entries separated by '|', got {value!r}")
    items = [os.fspath(item).strip() if isinstance(item, (str, os.PathLike)) else item for item in items]
    if not items or any(not isinstance(item, str) or not item for item in items):
        raise ValueError(f"model_arg `{name}` must list one or more entries separated by '|', got {value!r}")
    return items


def _weights(value) -> list[float]:
    """lm-eval turns `weights=0.5` into a float and `weights=1` into an int; `1.0|0.5` stays a string."""
    if isinstance(value, str):
        items = value.split("|")
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = [value]
    numbers = []
    for item in items:
        try:
            number = float(item.strip() if isinstance(item, str) else item) if not isinstance(item, bool) else None
        except (TypeError, ValueError):
            number = None
        if number is None or not math.isfinite(number):
            raise ValueError(f"model_arg `weights` must be numbers separated by '|' (finite), got {value!r}")
        numbers.append(number)
    return numbers


def _positive_integer(value, name: str) -> int:
    """An integer >= 1 from lm-eval's string `model_args` or a number; errors name the argument."""
    number = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.strip().lstrip("+").isdigit():
        number = int(value)
    if number is None or number < 1:
        raise ValueError(f"model_arg `{name}` must be a positive integer (it must be >= 1), got {value!r}")
    return number


def _choice(value, name: str, allowed) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"model_arg `{name}` must be one of {sorted(allowed)}, got {value!r}")
    return value


def _device(value) -> str:
    if not isinstance(value, str) or not _DEVICE.match(value):
        raise ValueError(f"model_arg `device` must be {MODEL_ARGS['device']}, got {value!r}")
    if value.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"model_arg `device` is {value!r} but no CUDA device is available; pass `--device cpu` "
            "(lm-eval's default is cuda)"
        )
    return value


def _source(value, name: str) -> str:
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value).strip():
        raise ValueError(f"model_arg `{name}` must be {MODEL_ARGS[name]}, got {value!r}")
    return os.fspath(value).strip()


@dataclass(frozen=True)
class ComposedModelArgs:
    """The `composed` model's model_args, checked (see `MODEL_ARGS`); `parse` is the one place that checks them."""

    base: str
    experts: list[str]
    weights: list[float] | None = None
    remedies: RemedySettings | None = None
    lora_implementation: str = "stacked"
    dtype: str = "float32"
    device: str = "cpu"
    batch_size: int = 1
    max_batch_size: int | None = None
    max_length: int | None = None
    chunk_megabytes: int = 1024

    @classmethod
    def parse(cls, model_args: Mapping[str, Any], lm_eval_config: Mapping[str, Any] | None = None) -> ComposedModelArgs:
        """Check `model_args` as lm-eval passes them (strings, or numbers and booleans already converted by
        `lm_eval.utils.simple_parse_args_string`), over lm-eval's own `batch_size`, `max_batch_size` and `device`
        (`lm_eval_config`, its `additional_config`; None values are lm-eval's "not given")."""
        given = {key: value for key, value in (lm_eval_config or {}).items() if value is not None}
        given.update({key: value for key, value in model_args.items() if value is not None})
        unknown = [name for name in given if name not in MODEL_ARGS]
        if unknown:
            hints = {name: difflib.get_close_matches(str(name), MODEL_ARGS, n=1) for name in unknown}
            close = "".join(f"; did you mean {hints[name][0]!r} for {name!r}?" for name in unknown if hints[name])
            raise ValueError(
                f"the composed model takes no model_arg {unknown}{close}; valid model_args: {list(MODEL_ARGS)}"
            )
        missing = [name for name in _REQUIRED if name not in given]
        if missing:
            raise ValueError(
                "model_args " + ", ".join(f"`{name}` ({MODEL_ARGS[name]})" for name in missing) + " missing; "
                "e.g. --model_args base=BASE,experts=EXPERT1|EXPERT2"
            )
        remedies = given.get("remedies")
        if isinstance(remedies, dict):
            remedies = RemedySettings.model_validate(remedies)
        elif remedies is not None and not isinstance(remedies, RemedySettings):
            remedies = RemedySettings.parse(str(remedies))
        optional_integer = {
            name: _positive_integer(given[name], name) if name in given else None
            for name in ("max_batch_size", "max_length")
        }
        return cls(
            base=_source(given["base"], "base"),
            experts=split_list(given["experts"], "experts"),
            weights=_weights(given["weights"]) if "weights" in given else None,
            remedies=remedies,
            lora_implementation=_choice(
                given.get("lora_implementation", "stacked"), "lora_implementation", _LORA_IMPLEMENTATIONS
            ),
            dtype=_choice(given.get("dtype", "float32"), "dtype", DTYPES),
            device=_device(given.get("device", "cpu")),
            batch_size=_positive_integer(given.get("batch_size", 1), "batch_size"),  # lm-eval's "auto" is not supported
            chunk_megabytes=_positive_integer(given.get("chunk_megabytes", 1024), "chunk_megabytes"),
            **optional_integer,
        )


@register_model("composed")
class ComposedHFLM(HFLM):
    """lm-eval's `HFLM` whose model calls are those of a `ComposedLM` (see the module docstring)."""

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> ComposedHFLM:
        """lm-eval's string form `base=…,experts=…|…`, typed as lm-eval types it, over lm-eval's own settings."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> ComposedHFLM:
        """`arg_dict` over lm-eval's `additional_config` (`batch_size`, `device`): no "multiple values" clash."""
        return cls(ComposedModelArgs.parse(arg_dict, additional_config))

    def __init__(self, base: str | ComposedModelArgs | None = None, experts: Any = None, **model_args: Any) -> None:
        """`ComposedHFLM(base, experts, **model_args)` (checked by `ComposedModelArgs.parse`), or one
        `ComposedModelArgs` already checked."""
        if isinstance(base, ComposedModelArgs):
            if experts is not None or model_args:
                raise ValueError("give the model_args either checked (ComposedModelArgs) or as keywords, not both")
            args = base
        else:
            named = {"base": base, "experts": experts}
            args = ComposedModelArgs.parse({**{k: v for k, v in named.items() if v is not None}, **model_args})
        self.chunk_bytes = args.chunk_megabytes * 2**20
        composed = ComposedLM.from_pretrained(
            args.base,
            experts=args.experts,
            weights=args.weights,
            lora_implementation=args.lora_implementation,
            dtype=DTYPES[args.dtype],
            device_map=args.device,
        )
        if composed.tokenizer is None:
            raise ValueError(
                f"model_arg `base` {args.base!r} has no tokenizer files; lm-eval needs the base's tokenizer"
            )
        if args.remedies is not None:
            composed.remedies = tuple(args.remedies.build(composed.tokenizer.eos_token_id))
        self.composed = composed
        batching = {} if args.max_batch_size is None else {"max_batch_size": args.max_batch_size}
        super().__init__(
            pretrained=composed.base_model,
            tokenizer=composed.tokenizer,
            batch_size=args.batch_size,
            max_length=args.max_length,
            **batching,
        )

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """Composed log-probs `(B, T, V)` float32 of right-padded `inps` `(B, T)`, in chunks of rows."""
        if attn_mask is not None or labels is not None:
            raise ValueError("the composed model is a causal LM; encoder-decoder calls are not supported")
        batch, length = inps.shape
        components = len(self.composed.expert_names) + 1
        row_bytes = components * length * self.composed.vocab_size * 4
        rows = max(1, self.chunk_bytes // row_bytes)
        with torch.no_grad():
            parts = [self.composed.logprobs(inps[start : start + rows]) for start in range(0, batch, rows)]
        return torch.cat(parts)  # (B, T, V)

    def _model_generate(
        self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs
    ) -> torch.Tensor:
        """`ComposedLM.generate` with lm-eval's stop sequences and the task's sampling settings."""
        attention_mask = generation_kwargs.pop("attention_mask", None)
        unknown = sorted(set(generation_kwargs) - set(_SAMPLING_KWARGS))  # HFLM took `until` and `max_gen_toks`
        if unknown:
            raise ValueError(
                f"generation settings {unknown} are not supported by the composed model; "
                f"supported: {list(_SAMPLING_KWARGS)}"
            )
        # lm-eval adds the EOS token's text to the stop strings; EOS already ends a row by its id.
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        temperature = float(generation_kwargs.get("temperature", 0.0) or 0.0)
        do_sample = bool(generation_kwargs.get("do_sample", temperature > 0.0))
        return self.composed.generate(
            context,
            attention_mask,
            max_new_tokens=max_length - context.shape[1],
            do_sample=do_sample,
            temperature=temperature if do_sample else 1.0,
            top_k=generation_kwargs.get("top_k"),
            top_p=generation_kwargs.get("top_p"),
            seed=generation_kwargs.get("seed"),
            eos_token_id=self.eot_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
            stop_strings=[text for text in stop if text and text != eos_text],
            tokenizer=self.tokenizer,
        )
