"""`DecodingConfig`: how `ComposedLM.generate` decodes, checked once, before any forward pass.

`generate` builds one from its keyword arguments, as transformers' `generate(**kwargs)` builds a
`GenerationConfig`, or takes one as `generate(config=...)`.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeGuard

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mergecompose.composition.architecture import vocab_size
from mergecompose.composition.loading import vocab_difference

DEFAULT_DRAFT_TOKENS = 4

_SHARED_BASE_DRAFT = (
    "draft: these LoRA experts share one base, so composing them costs little more than one pass of the base where "
    "reading the weights dominates (batch 1 on a GPU, a large model on a CPU); there a draft, itself a pass of the "
    "base per drafted token, can only lose (see docs/guides/speculative-decoding.md)"
)


# The numbers ABCs take numpy's and torch's scalars too; the guards say int and float, which mypy can compare.
def is_integer(value: object) -> TypeGuard[int]:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class DecodingConfig:
    """The decoding options of `ComposedLM.generate`, with its defaults.

    `max_new_tokens`, `do_sample`, `temperature`, `top_k` and `top_p` are those of transformers' `generate`;
    `seed` seeds the generator that sampled tokens are drawn with (None: torch's global one).

    `eos_token_id` (an id or a list of ids) defaults to the base model's generation config;
    `eos_token_id=[]` turns EOS stopping off. `pad_token_id` defaults to the generation
    config's, then to the first EOS id, then to 0.

    `stop_strings` (one string or several, none empty; needs `generate`'s `tokenizer`, default the
    ComposedLM's) are matched as transformers' `StopStringCriteria` matches them, which `generate`
    runs, but on the row's generated tokens only: a row stops after step t when some
    stop string occurs in the text of its generated tokens 1…t and ends inside token t. Each
    token counts as its vocabulary string, so a stop string may span several tokens and may
    end partway into the last one (for "stop", tokens "st" + "op" and "st" + "opera" both
    stop); since the check runs at every step, this is the first step at which a stop string
    occurs in the generated text. One difference from `model.generate(stop_strings=...)`:
    transformers checks prompt and generated tokens together, so there a match may start in
    the prompt ("c" ending the prompt + a generated "A" completes "cA"); here, as in
    lm-evaluation-harness' `generate_until`, a match lies within the generated tokens.

    A prompt whose length plus `max_new_tokens` exceeds the model's context is an error; with
    `truncate=True` its oldest tokens are dropped (left truncation, as lm-evaluation-harness
    does) so that it fits, with a warning that says how many. The returned rows then start
    with the kept part of the prompt.

    **Speculative decoding** (speculative/decoding.py): with `draft`, a draft model proposes
    up to `num_draft_tokens` = K_max tokens a round (default 4), the components score
    all K+1 positions in one pass each, and the acceptance rule of Leviathan et al. (2023)
    keeps the output exactly that of decoding without a draft: greedy, token for token (up to
    float rounding between one pass over K+1 tokens and K+1 passes over one); sampling, in
    distribution (the same seed draws other tokens). Temperature, top-k and top-p apply to
    the composed target and to the draft before the test; the remedies apply to the target.
    `draft="merged"` is the task-arithmetic merge of this composition's own experts,
    θ_b + Σ_i λ_i (θ_i − θ_b), with λ_i = the composition's weights unless `draft_lambda`
    gives them; it is built once per λ and kept (`merged_draft`). A model given as `draft`
    must have the composition's vocabulary and device, and, where both are known, the same
    tokenizer (`draft_tokenizer`). Rows of a batch accept their own numbers of tokens.
    `speculation_stats` then says what happened (acceptance rate, tokens per round).
    With `adaptive_draft` (default True) each round's K is chosen from 0…K_max by the acceptance
    rate and the round times seen so far (speculative/draft_length.py), K = 0 being a plain decoding step: where
    drafting costs more than it saves, decoding falls back to plain steps and tries a draft again now
    and then. Greedy output stays token for token that of plain decoding; sampled draws then depend
    on timings too, so pass `adaptive_draft=False` (K fixed at `num_draft_tokens`) for draws that
    repeat from run to run with a seed. With
    LoRA experts on one shared base this warns: composing them already costs about one
    pass of the base, so a draft can only add work.

    Checked when built: the sampling options by the rules of transformers' warpers
    (`TemperatureLogitsWarper`: temperature > 0; `TopKLogitsWarper`: an integer top_k ≥ 1, and as in
    `generate`, 0 or None for none; `TopPLogitsWarper`: top_p in [0, 1]), plus NaN and ±inf, which those
    let through; the draft options by their kind. What depends on the composition (one λ per expert, a
    draft model's device, vocabulary and tokenizer, the EOS and pad ids, the stop strings with their
    tokenizer) is checked by `generate`, before it runs a model.
    """

    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    eos_token_id: int | Sequence[int] | None = None
    pad_token_id: int | None = None
    seed: int | None = None
    stop_strings: str | Sequence[str] | None = None
    truncate: bool = False
    draft: str | PreTrainedModel | None = field(default=None, repr=False)
    num_draft_tokens: int | None = None
    draft_lambda: Sequence[float] | None = None
    draft_tokenizer: PreTrainedTokenizerBase | None = field(default=None, repr=False)
    adaptive_draft: bool = True

    def __post_init__(self) -> None:
        self._check_sampling()
        self._check_draft()

    @classmethod
    def from_arguments(cls, config: DecodingConfig | None, **arguments: Any) -> DecodingConfig:
        """`generate`'s decoding options as a config: `config`'s fields (or the defaults), replaced by each option
        given. An unknown option is a TypeError that lists the known ones."""
        if config is not None and not isinstance(config, DecodingConfig):
            raise TypeError(f"`config` must be a DecodingConfig or None, got {type(config).__name__}")
        known = [option.name for option in fields(cls)]
        unknown = sorted(set(arguments) - set(known))
        if unknown:
            raise TypeError(
                f"`generate` got unknown options {unknown}; the decoding options (DecodingConfig) are {known}, and "
                f"the other arguments {list(GENERATE_INPUTS)}"
            )
        if config is None:
            return cls(**arguments)
        return replace(config, **arguments) if arguments else config

    @property
    def draft_tokens(self) -> int:
        """K, the tokens drafted a round; 0 without a draft."""
        if self.draft is None:
            return 0
        return DEFAULT_DRAFT_TOKENS if self.num_draft_tokens is None else self.num_draft_tokens

    def check_draft_fits(
        self,
        num_experts: int,
        device: torch.device,
        vocab: int,
        tokenizer: PreTrainedTokenizerBase | None,
        shares_one_base: bool,
    ) -> None:
        """The draft options that depend on the composition: one finite λ_i per expert for draft='merged'; a draft
        model on the composition's device, with its vocabulary and, where both are known, its tokenizer.

        Called by `ComposedLM.generate`: the warning for LoRA experts on one base names its caller."""
        if self.draft is None:
            return
        self._check_draft_fits(num_experts, device, vocab, tokenizer)
        if shares_one_base:
            warnings.warn(
                _SHARED_BASE_DRAFT,
                UserWarning,
                stacklevel=4,  # check_draft_fits, generate, torch.no_grad's wrapper, the caller
            )

    def _check_draft_fits(
        self, num_experts: int, device: torch.device, vocab: int, tokenizer: PreTrainedTokenizerBase | None
    ) -> None:
        draft, draft_lambda = self.draft, self.draft_lambda
        if draft is None:
            return
        if isinstance(draft, str):
            if draft_lambda is not None and not (
                isinstance(draft_lambda, (Sequence, torch.Tensor))
                and not isinstance(draft_lambda, (str, bytes))
                and len(draft_lambda) == num_experts
                and all(is_number(x) and math.isfinite(x) for x in draft_lambda)
            ):
                raise ValueError(
                    f"`draft_lambda` must hold one finite λ_i per expert ({num_experts}), got {draft_lambda!r}"
                )
            return
        parameter = next(draft.parameters(), None)
        if parameter is not None and parameter.device != device:
            raise ValueError(f"`draft` must be on the composition's device {device}, got a model on {parameter.device}")
        draft_vocab = vocab_size(draft)
        if draft_vocab != vocab:
            raise ValueError(
                f"`draft` must have the composition's vocabulary of {vocab} tokens, got a model with "
                f"{draft_vocab} output tokens"
            )
        if self.draft_tokenizer is not None and tokenizer is not None:
            difference = vocab_difference(self.draft_tokenizer, tokenizer)
            if difference:
                raise ValueError(
                    f"`draft_tokenizer` must be the composition's tokenizer, got one that differs: {difference}"
                )

    def _check_sampling(self) -> None:
        max_new_tokens, temperature, top_k, top_p = self.max_new_tokens, self.temperature, self.top_k, self.top_p
        if not is_integer(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"`max_new_tokens` must be >= 1, got {max_new_tokens!r} (an integer number of tokens)")
        if self.do_sample not in (True, False):
            raise ValueError(f"`do_sample` must be True or False, got {self.do_sample!r}")
        greedy_zero = not self.do_sample and is_number(temperature) and temperature == 0  # "temperature 0" = greedy
        if not greedy_zero and not (is_number(temperature) and math.isfinite(temperature) and temperature > 0):
            raise ValueError(
                f"`temperature` must be a finite number > 0, got {temperature!r}"
                + (" (for greedy decoding pass do_sample=False)" if temperature == 0 else "")
            )
        if top_k is not None and not (is_integer(top_k) and top_k >= 0):
            raise ValueError(f"`top_k` must be an integer >= 1 (0 or None: no top-k filtering), got {top_k!r}")
        if top_p is not None and not (is_number(top_p) and 0 <= top_p <= 1):
            raise ValueError(f"`top_p` must be a number in [0, 1] (1 or None: no nucleus filtering), got {top_p!r}")
        if self.seed is not None and not is_integer(self.seed):
            raise ValueError(f"`seed` must be an integer or None, got {self.seed!r}")

    def _check_draft(self) -> None:
        """The speculative-decoding options that need no composition to check."""
        draft, draft_lambda, draft_tokenizer = self.draft, self.draft_lambda, self.draft_tokenizer
        if self.adaptive_draft not in (True, False):
            raise ValueError(f"`adaptive_draft` must be True or False, got {self.adaptive_draft!r}")
        if draft is None:
            options = [("num_draft_tokens", self.num_draft_tokens), ("draft_lambda", draft_lambda)]
            given = [name for name, value in [*options, ("draft_tokenizer", draft_tokenizer)] if value is not None]
            if given:
                raise ValueError(f"`{given[0]}` needs a draft; pass `draft='merged'` or a draft model, or leave it out")
            return
        if not is_integer(self.draft_tokens) or self.draft_tokens < 1:
            raise ValueError(
                f"`num_draft_tokens` must be an integer >= 1 (tokens drafted a round), got {self.num_draft_tokens!r}"
            )
        if isinstance(draft, str):
            if draft != "merged":
                raise ValueError(
                    f"`draft` must be None, 'merged' or a causal LM with the composition's vocabulary, got {draft!r}"
                )
            if draft_tokenizer is not None:
                raise ValueError(
                    "`draft_tokenizer` is for a draft model; draft='merged' has the composition's tokenizer"
                )
            return
        if not isinstance(draft, torch.nn.Module) or not hasattr(draft, "get_output_embeddings"):
            raise TypeError(f"`draft` must be None, 'merged' or a transformers causal LM, got {type(draft).__name__}")
        if draft_lambda is not None:
            raise ValueError("`draft_lambda` sets the λ_i of draft='merged'; a draft model is used as given")


# The arguments of `generate` that are not decoding options: the prompt's positions and the generated tokens'
# (inputs of the model, as in transformers' forward), the tokenizer that matches stop strings, and the streamer.
GENERATE_INPUTS = ("position_ids", "generated_position_ids", "tokenizer", "streamer")
# `generate`'s positional arguments after `attention_mask` before 0.2, in order; deprecated for one release.
_OLD_POSITIONAL = (
    "max_new_tokens",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "eos_token_id",
    "pad_token_id",
    "seed",
    "position_ids",
    "generated_position_ids",
)


def decoding_arguments(
    config: object, positional: Sequence[object], options: dict[str, Any], inputs: dict[str, Any]
) -> tuple[DecodingConfig, dict[str, Any]]:
    """`generate`'s arguments after `attention_mask` as (its `DecodingConfig`, its `inputs`: `GENERATE_INPUTS`
    other than the tokenizer and the streamer). `config`, `positional` and `options` are as `generate` got them; the
    old positional form, `generate(ids, mask, 32, False, …)` (`config` holding what came third, `max_new_tokens`),
    gives a DeprecationWarning and still works for one release."""
    if positional or is_integer(config):
        values = (config, *positional)
        if len(values) > len(_OLD_POSITIONAL):
            raise TypeError(
                f"`generate` takes at most {len(_OLD_POSITIONAL)} arguments after `attention_mask` in the old "
                f"positional form ({', '.join(_OLD_POSITIONAL)}), got {len(values)}; pass options by keyword"
            )
        warnings.warn(
            "passing decoding options to `ComposedLM.generate` by position is deprecated and will be removed in the "
            "next release; pass them by keyword (`max_new_tokens=...`) or as `config=DecodingConfig(...)`",
            DeprecationWarning,
            stacklevel=4,  # decoding_arguments, generate, torch.no_grad's wrapper, the caller
        )
        named = dict(zip(_OLD_POSITIONAL, values))
        twice = sorted(name for name in named if options.get(name) is not None or inputs.get(name) is not None)
        if twice:
            raise TypeError(f"`generate` got {twice} both by position and by keyword")
        inputs = {**inputs, **{name: named.pop(name) for name in list(named) if name in inputs}}
        config, options = None, {**named, **options}
    return DecodingConfig.from_arguments(config, **options), inputs  # type: ignore[arg-type]
