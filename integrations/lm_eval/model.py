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
* `dtype` (default float32), `device` (default cpu), `batch_size` (an integer), `max_length`,
  `chunk_megabytes` (see below).

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

import lm_eval.models  # noqa: F401  (lm-eval's own models first: its registry loads them only while empty)
import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from mergecompose.composition.model import ComposedLM
from mergecompose.composition.remedies import RemedySettings

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_SAMPLING_KWARGS = ("do_sample", "temperature", "top_k", "top_p", "seed")


def split_list(value, name: str) -> list[str]:
    """A `|`-separated string (lm-eval's string `model_args`) or a list, as a list of non-empty strings."""
    items = value.split("|") if isinstance(value, str) else list(value)
    items = [str(item).strip() for item in items]
    if not items or any(not item for item in items):
        raise ValueError(f"`{name}` must list one or more entries separated by '|', got {value!r}")
    return items


def _number(text, name: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"`{name}` must be numbers separated by '|', got {text!r}") from None


def _positive_integer(value, name: str) -> int:
    """An integer >= 1 from lm-eval's string `model_args` or a number; errors name the argument."""
    try:
        number = int(str(value).strip()) if not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None or number < 1:
        raise ValueError(f"`{name}` must be a positive integer (it must be >= 1), got {value!r}")
    return number


@register_model("composed")
class ComposedHFLM(HFLM):
    """lm-eval's `HFLM` whose model calls are those of a `ComposedLM` (see the module docstring)."""

    def __init__(
        self,
        base: str,
        experts,
        weights=None,
        remedies: str | RemedySettings | None = None,
        lora_implementation: str = "stacked",
        dtype: str = "float32",
        device: str = "cpu",
        batch_size: int | str = 1,
        max_length: int | None = None,
        chunk_megabytes: int | str = 1024,
        **kwargs,
    ) -> None:
        experts = split_list(experts, "experts")
        if weights is not None:
            weights = [_number(weight, "weights") for weight in split_list(weights, "weights")]
        if str(dtype) not in _DTYPES:
            raise ValueError(f"`dtype` must be one of {sorted(_DTYPES)}, got {dtype!r}")
        batch_size = _positive_integer(batch_size, "batch_size")  # lm-eval's "auto" is not supported
        self.chunk_bytes = _positive_integer(chunk_megabytes, "chunk_megabytes") * 2**20
        if max_length is not None:
            max_length = _positive_integer(max_length, "max_length")
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(
                f"`device` is {device!r} but no CUDA device is available; pass `--device cpu` "
                "(lm-eval's default is cuda)"
            )
        if remedies is not None and not isinstance(remedies, RemedySettings):
            remedies = RemedySettings.parse(remedies)  # checked before any model is loaded
        composed = ComposedLM.from_pretrained(
            base,
            experts=experts,
            weights=weights,
            lora_implementation=lora_implementation,
            dtype=_DTYPES[str(dtype)],
            device_map=device,
        )
        if composed.tokenizer is None:
            raise ValueError(f"`base` {base!r} has no tokenizer files; lm-eval needs the base's tokenizer")
        if remedies is not None:
            composed.remedies = tuple(remedies.build(composed.tokenizer.eos_token_id))
        self.composed = composed
        super().__init__(
            pretrained=composed.base_model,
            tokenizer=composed.tokenizer,
            batch_size=batch_size,
            max_length=max_length,
            **kwargs,
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
        unknown = sorted(set(generation_kwargs) - set(_SAMPLING_KWARGS))
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
