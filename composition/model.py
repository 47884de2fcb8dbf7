"""ComposedLM: a base causal LM and k experts composed at every decoding step.

Two backends share one interface:

* `_SeparateModels`: k+1 full transformers models, one KV cache each.
* `_SharedAdapters`: one base with k peft LoRA adapters. The batch is replicated k+1 times
  (component-major) and one forward pass with peft's mixed-adapter batch
  (`adapter_names=["__base__"]*B + [name_1]*B + ...`) returns every component; one cache.

`close()` (or leaving a `with` block) gives the caller's base model back as it was.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    LogitsProcessorList,
    PreTrainedModel,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from mergecompose.composition.remedies import compose_with_remedies
from mergecompose.composition.rule import check_weights
from mergecompose.composition.speculative import (
    SpeculationStats,
    merged_full_draft,
    merged_lora_draft,
    speculative_decode,
)
from mergecompose.composition.stacked_lora import StackedLoRA, StackedLoRAUnsupported
from mergecompose.core.adapters import TrainingFlags, check_adapter_names, load_adapters_on_base, merged_adapter_model
from mergecompose.core.sources import check_model_source, source_kind

logger = logging.getLogger(__name__)

LORA_IMPLEMENTATIONS = ("stacked", "peft")
DEFAULT_DRAFT_TOKENS = 4


def vocab_size(model: torch.nn.Module) -> int:
    """The size of the model's output distribution (rows of the output embedding)."""
    output_embeddings = model.get_output_embeddings()
    if output_embeddings is not None and hasattr(output_embeddings, "weight"):
        return int(output_embeddings.weight.shape[0])
    return int(model.config.vocab_size)


# Config fields that hold the number of positions a model was built for, in the order looked up.
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx")


def context_length(model: torch.nn.Module) -> int | None:
    """The number of positions the model was built for (`max_position_embeddings` or a synonym), or None."""
    config = getattr(model, "config", None)
    for name in _CONTEXT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def as_token_ids(value, name: str = "input_ids") -> torch.Tensor:
    """`value` as a non-empty `(batch, seq)` integer tensor; a list of equal-length lists is converted.

    Raises TypeError for something that is not a tensor or a list, or holds no integers; ValueError
    for another shape. The range of the ids is checked where the vocabulary is known."""
    if isinstance(value, (list, tuple)):
        try:
            value = torch.tensor(value)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(
                f"`{name}` must be a (batch, seq) tensor or a list of equal-length lists of token ids; "
                f"could not convert the list: {error}"
            ) from None
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"`{name}` must be a (batch, seq) torch.Tensor of token ids (or a list of lists), got {type(value).__name__}"
        )
    if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
        raise TypeError(f"`{name}` must hold integer token ids, got dtype {value.dtype}")
    if value.dim() != 2 or value.numel() == 0:
        raise ValueError(f"`{name}` must be a non-empty (batch, seq) tensor, got shape {tuple(value.shape)}")
    return value


def as_mask(value, shape: tuple, name: str = "attention_mask") -> torch.Tensor:
    """`value` as a long tensor of 0s and 1s of `shape`; a list is converted. Errors name the bad value."""
    if isinstance(value, (list, tuple)):
        try:
            value = torch.tensor(value)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(
                f"`{name}` must be a tensor or a list of equal-length lists of 0/1; could not convert it: {error}"
            ) from None
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"`{name}` must be a torch.Tensor of 0s and 1s (or a list of lists), got {type(value).__name__}"
        )
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"`{name}` must have the shape of `input_ids` {tuple(shape)}, got {tuple(value.shape)}")
    invalid = (value != 0) & (value != 1)
    if invalid.any():
        raise ValueError(
            f"`{name}` must hold only 0 and 1 (1 = a token, 0 = padding), got {value[invalid][0].item()!r}"
        )
    return value.long()


def _is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_decoding(max_new_tokens, do_sample, temperature, top_k, top_p, seed) -> None:
    """The sampling arguments, checked by the rules of transformers' warpers (`TemperatureLogitsWarper`:
    temperature > 0; `TopKLogitsWarper`: an integer top_k ≥ 1, and as in `generate`, 0 or None for
    none; `TopPLogitsWarper`: top_p in [0, 1]), plus NaN and ±inf, which those let through."""
    if not _is_integer(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"`max_new_tokens` must be >= 1, got {max_new_tokens!r} (an integer number of tokens)")
    if do_sample not in (True, False):
        raise ValueError(f"`do_sample` must be True or False, got {do_sample!r}")
    greedy_zero = not do_sample and _is_number(temperature) and temperature == 0  # "temperature 0" = greedy
    if not greedy_zero and not (_is_number(temperature) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(
            f"`temperature` must be a finite number > 0, got {temperature!r}"
            + (" (for greedy decoding pass do_sample=False)" if temperature == 0 else "")
        )
    if top_k is not None and not (_is_integer(top_k) and top_k >= 0):
        raise ValueError(f"`top_k` must be an integer >= 1 (0 or None: no top-k filtering), got {top_k!r}")
    if top_p is not None and not (_is_number(top_p) and 0 <= top_p <= 1):
        raise ValueError(f"`top_p` must be a number in [0, 1] (1 or None: no nucleus filtering), got {top_p!r}")
    if seed is not None and not _is_integer(seed):
        raise ValueError(f"`seed` must be an integer or None, got {seed!r}")


def _cache_kwarg(model: torch.nn.Module) -> str:
    """transformers renamed `past_key_values` to `cache` during 5.x; pass whichever is native."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


class _SeparateModels:
    """k+1 full models, run one after another, each with its own DynamicCache."""

    def __init__(self, models: Sequence[PreTrainedModel]):
        self.models = list(models)
        self.cache_kwargs = [_cache_kwarg(model) for model in self.models]

    @property
    def device(self) -> torch.device:
        return self.models[0].device

    @property
    def base_model(self) -> PreTrainedModel:
        return self.models[0]

    def new_cache(self):
        return [DynamicCache(config=model.config) for model in self.models]

    def close(self) -> None:
        """Nothing to undo: the models are used as given."""

    def forward(self, input_ids, attention_mask, position_ids, cache=None, logits_to_keep=0):
        """Return logits (k+1, B, T', V) for every component, base first."""
        outputs = []
        for index, model in enumerate(self.models):
            kwargs = {} if cache is None else {self.cache_kwargs[index]: cache[index], "use_cache": True}
            logits = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                logits_to_keep=logits_to_keep,
                **kwargs,
            ).logits  # (B, T', V)
            outputs.append(logits)
        return torch.stack(outputs)  # (k+1, B, T', V)


class _SharedAdapters:
    """One base with LoRA adapters; every component in one forward pass over a replicated batch.

    Rows are component-major: `[base | expert_1 | … | expert_k]`, B rows each. Two
    implementations give the same numbers (pinned in tests):

    * "stacked" (default, faster): the LoRA products of all experts are added with one batched
      matmul per module (`StackedLoRA`), on the plain base model.
    * "peft": peft's mixed-adapter batch, `adapter_names=["__base__"]*B + [name_1]*B + ...`.

    The adapters are loaded onto `base_model` in place; `close()` gives it back as it was (no
    LoRA layers, no patched forwards, its train/eval modes and `requires_grad` flags).
    """

    def __init__(self, base_model: PreTrainedModel, adapters: Mapping[str, object], implementation: str = "stacked"):
        self.flags = TrainingFlags(base_model)  # before peft freezes the base and sets eval()
        self.adapters = dict(adapters)  # the sources, for a merged draft
        peft_model, adapter_names = load_adapters_on_base(base_model, adapters)
        self.components = ["__base__", *adapter_names]
        self.stacked = None
        if implementation == "stacked":
            try:
                self.stacked = StackedLoRA(peft_model, adapter_names)
            except StackedLoRAUnsupported as reason:
                logger.info("using peft's mixed-adapter batches: %s", reason)
        self.implementation = "stacked" if self.stacked is not None else "peft"
        self.model = self.stacked.model if self.stacked is not None else peft_model
        self.base_model = self.model if self.stacked is not None else peft_model.get_base_model()
        self.cache_kwarg = _cache_kwarg(self.base_model)
        self._names_for_batch: dict[int, list[str]] = {}

    @property
    def device(self) -> torch.device:
        return self.base_model.device

    def new_cache(self):
        return DynamicCache(config=self.base_model.config)

    def close(self) -> None:
        """Remove the adapters from the base model (no merge) and restore its flags."""
        if self.stacked is not None:
            self.stacked.close()  # peft's LoRA layers were unloaded when the factors were stacked
        else:
            self.model.unload()
        self.flags.restore()

    def _adapter_names(self, batch: int) -> list[str]:
        if batch not in self._names_for_batch:
            self._names_for_batch[batch] = [name for name in self.components for _ in range(batch)]
        return self._names_for_batch[batch]

    def forward(self, input_ids, attention_mask, position_ids, cache=None, logits_to_keep=0):
        """Return logits (k+1, B, T', V): the batch runs once, replicated per component."""
        n = len(self.components)
        batch = input_ids.shape[0]
        kwargs = {} if cache is None else {self.cache_kwarg: cache, "use_cache": True}
        inputs = dict(
            input_ids=input_ids.repeat(n, 1),  # ((k+1)·B, T')
            attention_mask=attention_mask.repeat(n, *[1] * (attention_mask.dim() - 1)),  # 2D, or 4D (B, 1, T', C)
            position_ids=position_ids.repeat(n, 1),
            logits_to_keep=logits_to_keep,
            **kwargs,
        )
        if self.stacked is not None:
            with self.stacked.active():
                logits = self.model(**inputs).logits  # ((k+1)·B, T', V)
        else:
            logits = self.model(**inputs, adapter_names=self._adapter_names(batch)).logits
        return logits.view(n, batch, *logits.shape[1:])  # (k+1, B, T', V)


class ComposedLM:
    """Probability-space composition of a base causal LM and k experts sharing one vocabulary.

    At every position, `log p̂ = log p_b + Σ_i w_i (log p_i − log p_b)`, renormalised
    (Kumar, Bucarelli & Natale, 2026; see `compose_logprobs`). Optional `remedies`
    (`ActivityGate`, `PlausibilityFilter`, `TerminationRule` from `mergecompose.composition.remedies`) change
    the rule at every step; see `compose_with_remedies`.

    `close()`, or leaving a `with ComposedLM...(...) as lm:` block, gives the models back as
    they were (see `from_adapters`); the ComposedLM cannot be used afterwards.

    Args:
        base_model: a transformers causal LM.
        expert_models: k causal LMs with the base's vocabulary.
        weights: k exponents, default 1.0 each.
        tokenizers: optional tokenizers, one per component (base first) or a single one for all;
            when several are given their vocabularies must agree.
        remedies: rule changes applied at every step, in order.
        names: k unique, non-empty expert names (`expert_names`); default `expert_0`, `expert_1`, ...
    """

    def __init__(
        self,
        base_model: PreTrainedModel,
        expert_models: Sequence[PreTrainedModel],
        weights: Sequence[float] | None = None,
        tokenizers=None,
        remedies: Sequence[object] = (),
        *,
        names: Sequence[str] | None = None,
    ):
        if len(expert_models) == 0:
            raise ValueError("`expert_models` must hold at least one model, got an empty sequence")
        base_vocab = vocab_size(base_model)
        for index, expert in enumerate(expert_models):
            expert_vocab = vocab_size(expert)
            if expert_vocab != base_vocab:
                raise ValueError(
                    f"vocabulary size mismatch: `expert_models[{index}]` has {expert_vocab} output "
                    f"tokens, `base_model` has {base_vocab}; experts must share the base's vocabulary"
                )
        self._configure(
            len(expert_models),
            names=[f"expert_{index}" for index in range(len(expert_models))] if names is None else names,
            weights=weights,
            tokenizers=tokenizers,
            generation_config=getattr(base_model, "generation_config", None),
            remedies=remedies,
        )
        self.backend = _SeparateModels([base_model, *expert_models])

    def _configure(self, num_experts, names, weights, tokenizers, generation_config, remedies) -> None:
        """Check and set everything but the backend, so that bad arguments fail before any model is touched."""
        self.expert_names = _check_names(names, num_experts)
        self.num_experts = num_experts
        self.weights = _check_weights(weights, num_experts)
        self.tokenizer = _check_tokenizers(tokenizers, num_experts + 1)
        self.generation_config = generation_config
        self.remedies = tuple(remedies)
        self.backend = None
        self._closed = False
        self._merged_drafts: dict[tuple, PreTrainedModel] = {}
        # What the last `generate(draft=...)` did (None after a call without a draft).
        self.speculation_stats: SpeculationStats | None = None

    @classmethod
    def from_adapters(
        cls,
        base_model: PreTrainedModel,
        adapters: Mapping[str, str | os.PathLike | object],
        weights: Sequence[float] | None = None,
        tokenizer=None,
        lora_implementation: str = "stacked",
        remedies: Sequence[object] = (),
        *,
        names: Sequence[str] | None = None,
    ) -> ComposedLM:
        """Load several peft LoRA adapters onto one copy of `base_model`.

        `adapters` maps a name to an adapter folder, a hub id, or a `PeftModel` whose active
        adapter is taken. Its keys are the expert names; `names` may be left out, and if given must
        equal the keys in order (so that code passing `names=` works for every constructor).

        No copy of the base weights is made: `base_model` itself is changed in place (with
        "stacked", the forward of each of its `nn.Linear` is replaced by one that adds the LoRA
        products inside this object's forward passes only; with "peft", LoRA layers are injected
        into it), frozen and put in eval mode. `close()` (or leaving a `with` block) undoes all
        of it: same modules, parameters, flags and outputs as before. `lora_implementation` picks
        how the experts run in one batched pass (see `_SharedAdapters`); "stacked" falls back to
        "peft" for what it does not support (DoRA, LoRA on embeddings).
        """
        if not isinstance(adapters, Mapping) or len(adapters) == 0:
            raise ValueError(f"`adapters` must be a non-empty mapping of name -> adapter, got {adapters!r}")
        if names is not None and _check_names(names, len(adapters)) != list(adapters):
            raise ValueError(
                f"`names` must be left out or equal the keys of `adapters` in order, {list(adapters)}, "
                f"got {list(names)}; the keys already name the experts"
            )
        if lora_implementation not in LORA_IMPLEMENTATIONS:
            raise ValueError(
                f"`lora_implementation` must be one of {list(LORA_IMPLEMENTATIONS)}, got {lora_implementation!r}"
            )
        self = cls.__new__(cls)
        self._configure(
            len(adapters),
            names=list(adapters),
            weights=weights,
            tokenizers=tokenizer,
            generation_config=getattr(base_model, "generation_config", None),
            remedies=remedies,
        )
        self.backend = _SharedAdapters(base_model, adapters, lora_implementation)
        return self

    @classmethod
    def from_pretrained(
        cls,
        base: str | os.PathLike,
        experts: Sequence[str | os.PathLike],
        weights: Sequence[float] | None = None,
        remedies: Sequence[object] = (),
        *,
        names: Sequence[str] | None = None,
        lora_implementation: str = "stacked",
        **model_kwargs,
    ) -> ComposedLM:
        """Load a base and experts from local folders or hub ids.

        An expert folder with `adapter_config.json` is a peft adapter; anything else is a full
        checkpoint. All adapters: one shared base (`from_adapters`). All full checkpoints: one
        model each. A mix: each adapter is merged into its own copy of the base
        (`merge_and_unload`), since the shared-base path needs every expert to be an adapter.

        `names` default to the folder names (made unique with the index if they repeat); with
        all adapters they must also be valid peft adapter names.
        """
        if len(experts) == 0:
            raise ValueError("`experts` must name at least one checkpoint or adapter, got none")
        _check_weights(weights, len(experts))
        base = check_model_source(base, "base", adapter_hint="give its base as `base` and the adapter as an expert")
        is_adapter = [is_adapter_source(expert, f"experts[{index}]") for index, expert in enumerate(experts)]
        if names is None:
            names = [_name_from_path(expert, index) for index, expert in enumerate(experts)]
            if len(set(names)) != len(names):
                names = [f"{name}_{index}" for index, name in enumerate(names)]
        names = _check_names(names, len(experts))
        if all(is_adapter):
            check_adapter_names(names)
        model_kwargs = _attention_that_caps(base, model_kwargs)
        base_model = AutoModelForCausalLM.from_pretrained(base, **model_kwargs).eval()
        tokenizer = _try_load_tokenizer(base)
        if all(is_adapter):
            return cls.from_adapters(
                base_model,
                dict(zip(names, experts)),
                weights,
                tokenizer,
                lora_implementation=lora_implementation,
                remedies=remedies,
            )
        expert_models, tokenizers = [], [tokenizer]
        for index, (expert, adapter) in enumerate(zip(experts, is_adapter)):
            if adapter:
                fresh_base = AutoModelForCausalLM.from_pretrained(base, **model_kwargs)
                expert_models.append(merged_adapter_model(fresh_base, expert, f"experts[{index}]").eval())
                tokenizers.append(tokenizer)
            else:
                expert_models.append(AutoModelForCausalLM.from_pretrained(expert, **model_kwargs).eval())
                tokenizers.append(_try_load_tokenizer(expert))
        known = [t for t in tokenizers if t is not None]
        self = cls(
            base_model,
            expert_models,
            weights,
            tokenizers=tokenizers if len(known) == len(tokenizers) else None,
            remedies=remedies,
            names=names,
        )
        if self.tokenizer is None and known:
            self.tokenizer = known[0]
        return self

    # ------------------------------------------------------------------ giving the models back

    def close(self) -> None:
        """Give the caller's models back as they were; idempotent.

        For `from_adapters`: the LoRA layers or patched forwards are removed from the base model
        and its train/eval modes and `requires_grad` flags restored, so its modules, parameters and
        outputs are bitwise what they were. For full checkpoints nothing is changed. Afterwards
        this ComposedLM raises on use.
        """
        if self._closed:
            return
        self.backend.close()
        self.backend = None  # drop the references to the models
        self._merged_drafts = {}
        self._closed = True

    def __enter__(self) -> ComposedLM:
        self._check_open()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                "this ComposedLM was closed and has given its models back; build a new one to compose again"
            )

    # ------------------------------------------------------------------ teacher-forced scoring

    @property
    def device(self) -> torch.device:
        self._check_open()
        return self.backend.device

    @property
    def base_model(self) -> PreTrainedModel:
        """The base model (with LoRA experts: the shared base, with their layers while this is open)."""
        self._check_open()
        return self.backend.base_model

    @property
    def vocab_size(self) -> int:
        """The size of the output distribution, V."""
        return self.base_model.get_output_embeddings().weight.shape[0]

    @property
    def context_length(self) -> int | None:
        """The number of positions the base model was built for (`max_position_embeddings`), or None if unknown."""
        return context_length(self.base_model)

    @torch.no_grad()
    def component_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Teacher-forced next-token log-probs of every component: `(k+1, B, T, V)`, base first.

        `position_ids` `(B, T)` defaults to each row's token count (left padding skipped), as in
        `generate`."""
        self._check_open()
        input_ids, attention_mask, position_ids = self._prepare(input_ids, attention_mask, position_ids)
        self._check_context(position_ids, f"the input ({input_ids.shape[1]} tokens a row)")
        logits = self.backend.forward(input_ids, attention_mask, position_ids)  # (k+1, B, T, V)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        invalid = torch.isnan(logprobs)
        if invalid.any():
            component, row, position = invalid.nonzero()[0].tolist()[:3]
            name = ["base", *self.expert_names][component]
            raise ValueError(
                f"component {name!r} produced NaN log-probs at row {row}, position {position} (NaN or +inf "
                "logits); check its weights and dtype"
            )
        return logprobs

    @torch.no_grad()
    def logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Teacher-forced composed log-probs `(B, T, V)`."""
        components = self.component_logprobs(input_ids, attention_mask, position_ids)  # (k+1, B, T, V)
        return compose_with_remedies(components, self.weights, self.remedies)

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 32,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        seed: int | None = None,
        position_ids: torch.Tensor | None = None,
        generated_position_ids: torch.Tensor | None = None,
        *,
        stop_strings: str | Sequence[str] | None = None,
        tokenizer=None,
        truncate: bool = False,
        draft: str | PreTrainedModel | None = None,
        num_draft_tokens: int | None = None,
        draft_lambda: Sequence[float] | None = None,
        draft_tokenizer=None,
    ) -> torch.Tensor:
        """Decode from the composed distribution with one KV cache per component (or one shared one).

        `input_ids` is `(B, T)`, left-padded when rows differ in length (`attention_mask` 0 on the
        left). Returns `(B, T + n)` with n ≤ max_new_tokens: the prompt followed by the generated
        tokens. A row is finished at the step where it emits EOS or completes a stop string; its
        last token stays, later positions are `pad_token_id`, and decoding ends when every row is
        finished (n < max_new_tokens) or after `max_new_tokens`. In sampling, the token drawn from
        the composed distribution is appended to every component's row.

        `eos_token_id` (an id or a list of ids) defaults to the base model's generation config;
        `eos_token_id=[]` turns EOS stopping off. `pad_token_id` defaults to the generation
        config's, then to the first EOS id, then to 0.

        `stop_strings` (one string or several, none empty; needs `tokenizer`, default this
        ComposedLM's) are matched as transformers' `StopStringCriteria` matches them, which this
        method runs, but on the row's generated tokens only: a row stops after step t when some
        stop string occurs in the text of its generated tokens 1…t and ends inside token t. Each
        token counts as its vocabulary string, so a stop string may span several tokens and may
        end partway into the last one (for "stop", tokens "st" + "op" and "st" + "opera" both
        stop); since the check runs at every step, this is the first step at which a stop string
        occurs in the generated text. One difference from `model.generate(stop_strings=...)`:
        transformers checks prompt and generated tokens together, so there a match may start in
        the prompt ("c" ending the prompt + a generated "A" completes "cA"); here, as in
        lm-evaluation-harness' `generate_until`, a match lies within the generated tokens.

        Positions default to each row's token count (left padding skipped), continuing by one per
        generated token. A task that couples output positions to input positions can give
        `position_ids` `(B, T)` for the prompt and `generated_position_ids` `(B, max_new_tokens)`,
        the position of each generated token.

        A prompt whose length plus `max_new_tokens` exceeds the model's context is an error; with
        `truncate=True` its oldest tokens are dropped (left truncation, as lm-evaluation-harness
        does) so that it fits, with a warning that says how many. The returned rows then start
        with the kept part of the prompt.

        **Speculative decoding** (`mergecompose.composition.speculative`): with `draft`, a draft model proposes
        `num_draft_tokens` = K tokens (default 4, fixed: K does not adapt), the components score
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
        `speculation_stats` then says what happened (acceptance rate, tokens per round). With
        LoRA experts on one shared base this warns: composing them already costs about one
        pass of the base, so a draft can only add work.
        """
        self._check_open()
        _check_decoding(max_new_tokens, do_sample, temperature, top_k, top_p, seed)
        num_draft_tokens = self._check_draft(draft, num_draft_tokens, draft_lambda, draft_tokenizer)
        stop_criteria = _stop_criteria(stop_strings, self.tokenizer if tokenizer is None else tokenizer)
        if truncate and (position_ids is not None or generated_position_ids is not None):
            raise ValueError(
                "`truncate=True` needs the default positions; drop `position_ids` and `generated_position_ids`"
            )
        input_ids, attention_mask, position_ids = self._prepare(input_ids, attention_mask, position_ids)
        if truncate:
            input_ids, attention_mask, position_ids = self._truncate_prompt(input_ids, attention_mask, max_new_tokens)
        _check_left_padded(attention_mask)
        eos_ids, pad_id = self._special_ids(eos_token_id, pad_token_id)
        warpers = _warpers(do_sample, temperature, top_k, top_p)
        generator = None
        if do_sample and seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)

        batch, prompt_length = input_ids.shape
        total = prompt_length + max_new_tokens
        # Preallocated buffers: each step writes one column, nothing is re-concatenated.
        sequences = torch.full((batch, total), pad_id, dtype=input_ids.dtype, device=self.device)
        sequences[:, :prompt_length] = input_ids
        full_mask = torch.ones((batch, total), dtype=attention_mask.dtype, device=self.device)
        full_mask[:, :prompt_length] = attention_mask
        if generated_position_ids is None:
            generated_position_ids = position_ids[:, -1:] + 1 + torch.arange(max_new_tokens, device=self.device)
        generated_position_ids = as_token_ids(generated_position_ids, "generated_position_ids")
        if generated_position_ids.shape != (batch, max_new_tokens):
            raise ValueError(
                f"`generated_position_ids` must be (batch, max_new_tokens) = ({batch}, {max_new_tokens}), "
                f"got {tuple(generated_position_ids.shape)}"
            )
        generated_position_ids = generated_position_ids.to(self.device)  # (B, max_new_tokens)
        self._check_context(
            torch.cat([position_ids, generated_position_ids], dim=1),
            f"the prompt ({prompt_length} tokens a row) plus `max_new_tokens`={max_new_tokens}",
        )
        self.speculation_stats = None
        if draft is not None:
            draft_model = self.merged_draft(draft_lambda) if isinstance(draft, str) else draft
            sequences, self.speculation_stats, invalid = speculative_decode(
                self.backend,
                _SeparateModels([draft_model]),
                lambda logits: compose_with_remedies(logits, self.weights, self.remedies, validate=do_sample),
                (lambda scores: _warped_probabilities(warpers, scores)) if do_sample else None,
                input_ids=input_ids,
                attention_mask=attention_mask,
                positions=torch.cat([position_ids, generated_position_ids], dim=1),
                max_new_tokens=max_new_tokens,
                num_draft_tokens=num_draft_tokens,
                pad_id=pad_id,
                eos_ids=eos_ids,
                stop_criteria=stop_criteria,
                generator=generator,
                holes=not any(_has_sliding_window(model) for model in [self.base_model, draft_model]),
                bias_dtypes=(
                    _bias_dtype(getattr(self.backend, "models", [self.base_model])),
                    _bias_dtype([draft_model]),
                ),
            )
            if invalid:
                raise ValueError(_NAN_COMPOSITION)
            return sequences
        unfinished = torch.ones(batch, dtype=torch.bool, device=self.device)
        can_finish = eos_ids is not None or stop_criteria is not None
        # Greedy steps are checked for NaN on the device and the flag is read once at the end, so the
        # loop has no host sync but the "all rows finished?" check. Sampling validates every step:
        # NaN must not reach the sampler.
        invalid = torch.zeros((), dtype=torch.bool, device=self.device)

        cache = self.backend.new_cache()
        logits = self.backend.forward(input_ids, attention_mask, position_ids, cache, logits_to_keep=1)
        length = prompt_length
        for _ in range(max_new_tokens):
            step_logits = logits[:, :, -1]  # (k+1, B, V)
            scores = compose_with_remedies(step_logits, self.weights, self.remedies, validate=do_sample)  # (B, V)
            if do_sample:
                scores = warpers(sequences[:, :length], scores)
                probabilities = torch.softmax(scores, dim=-1)
                next_tokens = torch.multinomial(probabilities, 1, generator=generator).squeeze(1)  # (B,)
            else:
                invalid |= torch.isnan(scores).any()
                next_tokens = scores.argmax(dim=-1)  # (B,)
            next_tokens = torch.where(unfinished, next_tokens, pad_id)
            sequences[:, length] = next_tokens
            length += 1
            if eos_ids is not None:
                unfinished &= ~torch.isin(next_tokens, eos_ids)
            if stop_criteria is not None:
                # (B,): a stop string ends in the token just appended; the prompt is not looked at.
                unfinished &= ~stop_criteria(sequences[:, prompt_length:length], None)
            if can_finish and not unfinished.any():
                break
            if length == total:
                break
            step = length - prompt_length - 1  # index of the token just generated
            logits = self.backend.forward(
                next_tokens[:, None],
                full_mask[:, :length],
                generated_position_ids[:, step : step + 1],
                cache,
                logits_to_keep=1,
            )
        if invalid:
            raise ValueError(_NAN_COMPOSITION)
        return sequences[:, :length]

    # ------------------------------------------------------------------ drafts

    def merged_draft(self, draft_lambda: Sequence[float] | None = None) -> PreTrainedModel:
        """The task-arithmetic merge of this composition's experts, θ_b + Σ_i λ_i (θ_i − θ_b), as a model.

        λ_i defaults to the composition's weights w_i. Full experts are merged tensor by tensor
        (`mergecompose.composition.speculative.merged_full_draft`); LoRA experts add λ_i ΔW_i to a copy of the
        base (`merged_lora_draft`). Tensors the merge leaves unchanged are shared with the base.
        Built once per λ and kept until `close()`."""
        self._check_open()
        lambdas = tuple(self.weights or [1.0] * self.num_experts) if draft_lambda is None else tuple(draft_lambda)
        if lambdas not in self._merged_drafts:
            if isinstance(self.backend, _SeparateModels):
                model = merged_full_draft(self.backend.models[0], self.backend.models[1:], lambdas)
            else:
                model = merged_lora_draft(self.backend.base_model, self.backend.adapters, lambdas)
            self._merged_drafts[lambdas] = model
        return self._merged_drafts[lambdas]

    def _check_draft(self, draft, num_draft_tokens, draft_lambda, draft_tokenizer) -> int:
        """Check the speculative-decoding arguments before any work; return K."""
        if draft is None:
            given = [
                name
                for name, value in [
                    ("num_draft_tokens", num_draft_tokens),
                    ("draft_lambda", draft_lambda),
                    ("draft_tokenizer", draft_tokenizer),
                ]
                if value is not None
            ]
            if given:
                raise ValueError(f"`{given[0]}` needs a draft; pass `draft='merged'` or a draft model, or leave it out")
            return 0
        if num_draft_tokens is None:
            num_draft_tokens = DEFAULT_DRAFT_TOKENS
        if not _is_integer(num_draft_tokens) or num_draft_tokens < 1:
            raise ValueError(
                f"`num_draft_tokens` must be an integer >= 1 (tokens drafted a round), got {num_draft_tokens!r}"
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
            if draft_lambda is not None and not (
                isinstance(draft_lambda, (Sequence, torch.Tensor))
                and not isinstance(draft_lambda, (str, bytes))
                and len(draft_lambda) == self.num_experts
                and all(_is_number(x) and math.isfinite(x) for x in draft_lambda)
            ):
                raise ValueError(
                    f"`draft_lambda` must hold one finite λ_i per expert ({self.num_experts}), got {draft_lambda!r}"
                )
        else:
            self._check_draft_model(draft, draft_lambda, draft_tokenizer)
        if isinstance(self.backend, _SharedAdapters):
            warnings.warn(
                "draft: these LoRA experts share one base, so composing them costs little more than one pass of the "
                "base where reading the weights dominates (batch 1 on a GPU, a large model on a CPU); there a draft, "
                "itself a pass of the base per drafted token, can only lose (see README, 'Decoding with a draft: when to use one')",
                UserWarning,
                stacklevel=4,  # _check_draft, generate, torch.no_grad's wrapper, the caller
            )
        return num_draft_tokens

    def _check_draft_model(self, draft, draft_lambda, draft_tokenizer) -> None:
        if not isinstance(draft, torch.nn.Module) or not hasattr(draft, "get_output_embeddings"):
            raise TypeError(f"`draft` must be None, 'merged' or a transformers causal LM, got {type(draft).__name__}")
        if draft_lambda is not None:
            raise ValueError("`draft_lambda` sets the λ_i of draft='merged'; a draft model is used as given")
        parameter = next(draft.parameters(), None)
        if parameter is not None and parameter.device != self.device:
            raise ValueError(
                f"`draft` must be on the composition's device {self.device}, got a model on {parameter.device}"
            )
        draft_vocab = vocab_size(draft)
        if draft_vocab != self.vocab_size:
            raise ValueError(
                f"`draft` must have the composition's vocabulary of {self.vocab_size} tokens, got a model with "
                f"{draft_vocab} output tokens"
            )
        if draft_tokenizer is not None and self.tokenizer is not None:
            difference = _vocab_difference(draft_tokenizer, self.tokenizer)
            if difference:
                raise ValueError(
                    f"`draft_tokenizer` must be the composition's tokenizer, got one that differs: {difference}"
                )

    # ------------------------------------------------------------------ helpers

    def _prepare(self, input_ids, attention_mask, position_ids):
        """Check and move the inputs; default positions skip left padding. Returns all three `(B, T)`."""
        input_ids = as_token_ids(input_ids).to(self.device)
        vocabulary = self.vocab_size
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= vocabulary:
            raise ValueError(
                f"`input_ids` must be token ids in [0, {vocabulary}) (the model's vocabulary), got {low if low < 0 else high}"
            )
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        attention_mask = as_mask(attention_mask, input_ids.shape).to(self.device)
        if position_ids is None:
            position_ids = _position_ids(attention_mask)  # (B, T)
        position_ids = as_token_ids(position_ids, "position_ids")
        if position_ids.shape != input_ids.shape:
            raise ValueError(
                f"`position_ids` must have the shape of `input_ids` {tuple(input_ids.shape)}, got {tuple(position_ids.shape)}"
            )
        return input_ids, attention_mask, position_ids.to(self.device)

    def _truncate_prompt(self, input_ids, attention_mask, max_new_tokens: int):
        """Keep the last `context - max_new_tokens` columns of a (left-padded) prompt, and say so."""
        limit = self.context_length
        if limit is None or input_ids.shape[1] + max_new_tokens <= limit:
            return input_ids, attention_mask, _position_ids(attention_mask)
        keep = limit - max_new_tokens
        if keep < 1:
            raise ValueError(
                f"`max_new_tokens`={max_new_tokens} leaves no room for a prompt in the model's context of {limit}"
            )
        dropped = attention_mask[:, :-keep].sum(dim=1)  # (B,) real tokens cut from each row
        warnings.warn(
            f"truncate: cut the oldest tokens of {int((dropped > 0).sum())} of {input_ids.shape[0]} prompts "
            f"(up to {int(dropped.max())} tokens) to fit {keep} prompt + {max_new_tokens} new tokens into the "
            f"model's context of {limit}",
            UserWarning,
            stacklevel=3,
        )
        attention_mask = attention_mask[:, -keep:]
        return input_ids[:, -keep:], attention_mask, _position_ids(attention_mask)

    def _check_context(self, positions: torch.Tensor, what: str) -> None:
        """Refuse positions beyond the model's context: past it a model fails or silently degrades."""
        limit = self.context_length
        needed = int(positions.max()) + 1
        if limit is not None and needed > limit:
            raise ValueError(
                f"{what} needs {needed} positions, beyond the model's context of {limit} (`max_position_embeddings`); "
                "shorten it (`generate` can cut a prompt's oldest tokens with truncate=True)"
            )

    def _special_ids(self, eos_token_id, pad_token_id):
        config = self.generation_config
        if eos_token_id is None and config is not None:
            eos_token_id = config.eos_token_id
        if pad_token_id is None and config is not None:
            pad_token_id = config.pad_token_id
        vocabulary = self.vocab_size
        eos_ids = None
        if eos_token_id is not None:
            eos_list = [eos_token_id] if _is_integer(eos_token_id) else eos_token_id
            if (
                isinstance(eos_list, (str, bytes))
                or not isinstance(eos_list, Sequence)
                or not all(_is_integer(i) and 0 <= i < vocabulary for i in eos_list)
            ):
                raise ValueError(
                    f"`eos_token_id` (given, or the base model's generation config's) must be a token id in "
                    f"[0, {vocabulary}) or a list of them ([] for no EOS stopping), got {eos_token_id!r}"
                )
            if eos_list:  # an explicit [] means: no EOS stopping
                eos_ids = torch.tensor(list(eos_list), device=self.device)
                if pad_token_id is None:
                    pad_token_id = eos_list[0]
        if pad_token_id is not None and not (_is_integer(pad_token_id) and 0 <= pad_token_id < vocabulary):
            raise ValueError(
                f"`pad_token_id` (given, or the base model's generation config's) must be a token id in "
                f"[0, {vocabulary}), got {pad_token_id!r}"
            )
        return eos_ids, (0 if pad_token_id is None else int(pad_token_id))


def _position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: (B, T), 0 at each row's first real token."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def _check_left_padded(attention_mask: torch.Tensor) -> None:
    # Left padding means each row is non-decreasing: 0…0 1…1.
    if (attention_mask[:, 1:] < attention_mask[:, :-1]).any():
        raise ValueError(
            "`attention_mask` must be left-padded for generation (rows of the form 0…0 1…1); "
            "got a row with padding on the right. Set `tokenizer.padding_side = 'left'`."
        )
    if (attention_mask[:, -1] == 0).any():
        raise ValueError("`attention_mask` has a row with no tokens; every prompt needs at least one")


def _stop_criteria(stop_strings, tokenizer) -> StopStringCriteria | DecodedStops | None:
    """transformers' stop-string matcher for `stop_strings`, or None when there are none."""
    if stop_strings is None:
        return None
    stop_strings = [stop_strings] if isinstance(stop_strings, str) else stop_strings
    if not isinstance(stop_strings, Sequence) or not all(isinstance(text, str) for text in stop_strings):
        raise ValueError(f"`stop_strings` must be a string or a list of strings, got {stop_strings!r}")
    if not stop_strings:
        return None
    if any(text == "" for text in stop_strings):
        raise ValueError(
            f"`stop_strings` must be non-empty strings (an empty one would match everywhere), got {stop_strings!r}"
        )
    if tokenizer is None:
        raise ValueError(
            "`tokenizer` is needed to match `stop_strings` against generated tokens, and this ComposedLM has "
            "none; pass `tokenizer=` (the base model's tokenizer)"
        )
    try:
        return StopStringCriteria(tokenizer, list(stop_strings))
    except Exception:  # noqa: BLE001 - transformers cannot index this tokenizer's vocabulary for these strings
        # e.g. a tokenizer without an unknown token, or a stop string no token can produce.
        return DecodedStops(tokenizer, list(stop_strings))


class DecodedStops:
    """Stop strings matched on decoded text, where transformers' `StopStringCriteria` cannot be built.

    A row is finished once a stop string occurs in the decoded text of its generated tokens (as
    lm-eval's own stopping criterion matches them, on the last tokens only); a string no token
    sequence decodes to never matches. Called like a stopping criterion: `(generated (B, N), scores) -> (B,)` bool.
    """

    def __init__(self, tokenizer, stop_strings: list[str]):
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        # Called after every step: a match that ends in the newest token lies within the last
        # `longest` tokens (each token is at least one character), and earlier ones were seen before.
        self.window = max(len(text) for text in stop_strings)

    def __call__(self, generated: torch.Tensor, scores=None) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(generated[:, -self.window :].tolist(), skip_special_tokens=False)
        done = [any(stop in text for stop in self.stop_strings) for text in texts]
        return torch.tensor(done, dtype=torch.bool, device=generated.device)


def _has_sliding_window(model: torch.nn.Module) -> bool:
    """Whether the model's config sets a sliding attention window (Gemma-2, Mistral, ...): it counts cache columns."""
    return bool(getattr(getattr(model, "config", None), "sliding_window", None))


def _bias_dtype(models: Sequence[torch.nn.Module]) -> torch.dtype | None:
    """The dtype of a 4D additive attention mask these models all take as given, or None (pass the 2D mask):
    eager or SDPA attention, no sliding window (a 4D mask would replace the window), one dtype."""
    dtypes = {model.dtype for model in models}
    if len(dtypes) == 1 and all(
        getattr(model.config, "_attn_implementation", None) in ("eager", "sdpa") and not _has_sliding_window(model)
        for model in models
    ):
        return dtypes.pop()
    return None


_NAN_COMPOSITION = (
    "the composed distribution was NaN at some step: a component produced NaN logits, or "
    "every token was ruled out (-inf) by some component"
)


def _warped_probabilities(warpers: LogitsProcessorList, scores: torch.Tensor) -> torch.Tensor:
    """softmax(warpers(scores)) at every position, `(..., V)` -> `(..., V)`: what sampling draws from.

    The warpers (temperature, top-k, top-p) look at one row of scores each, never at the ids."""
    flat = scores.reshape(-1, scores.shape[-1])  # (N, V)
    no_ids = torch.zeros((flat.shape[0], 0), dtype=torch.long, device=flat.device)
    return torch.softmax(warpers(no_ids, flat), dim=-1).view(scores.shape)


def _warpers(do_sample, temperature, top_k, top_p) -> LogitsProcessorList:
    """transformers' own warpers, applied to the composed log-probs when sampling."""
    warpers = LogitsProcessorList()
    if not do_sample:
        return warpers
    if temperature is not None and temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(temperature)))
    if top_k is not None and top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers


def _check_names(names, num_experts: int) -> list[str]:
    """Return `names` as a list after checking: one per expert, non-empty strings, unique."""
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise ValueError(f"`names` must be a list or tuple of {num_experts} expert names, got {names!r}")
    names = list(names)
    if len(names) != num_experts:
        raise ValueError(f"`names` must hold one name per expert ({num_experts}), got {len(names)}: {names!r}")
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"`names` must be non-empty strings, got {name!r} in {names!r}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"`names` must be unique, got {repeated} more than once in {names!r}")
    return names


def _check_weights(weights, num_experts: int) -> list[float] | None:
    """One finite float per expert (`mergecompose.composition.rule.check_weights`)."""
    return check_weights(weights, num_experts)


def _check_tokenizers(tokenizers, n_components: int):
    """Return one tokenizer for the composition, after checking that all given ones agree."""
    if tokenizers is None:
        return None
    if not isinstance(tokenizers, (list, tuple)):
        return tokenizers
    if len(tokenizers) != n_components:
        raise ValueError(
            f"`tokenizers` must hold one tokenizer per component ({n_components}, base first), got {len(tokenizers)}"
        )
    for index, tokenizer in enumerate(tokenizers[1:]):
        difference = _vocab_difference(tokenizer, tokenizers[0])
        if difference:
            raise ValueError(
                f"tokenizer mismatch: the tokenizer of expert {index} differs from the base's: {difference}"
            )
    return tokenizers[0]


def _vocab_difference(tokenizer, reference) -> str:
    """How `tokenizer`'s vocabulary differs from `reference`'s, in words ("" if they are the same)."""
    vocab, reference_vocab = tokenizer.get_vocab(), reference.get_vocab()
    if vocab == reference_vocab:
        return ""
    differing = sorted(set(vocab.items()) ^ set(reference_vocab.items()))[:5]
    return f"{len(vocab)} tokens against {len(reference_vocab)}; first differing (token, id) pairs: {differing}"


def is_adapter_source(source: str | os.PathLike, argument: str = "source") -> bool:
    """True if `source` (a local folder or hub id) holds a peft adapter rather than a full model.

    A missing local folder, or one that is neither, raises a ValueError naming `argument`
    (`mergecompose.core.sources.source_kind`).
    """
    return source_kind(source, argument) == "adapter"


def _try_load_tokenizer(source):
    try:
        return AutoTokenizer.from_pretrained(source)
    except Exception:  # noqa: BLE001 - a checkpoint without a tokenizer is valid
        return None


def _attention_that_caps(base: str, model_kwargs: dict) -> dict:
    """`model_kwargs`, with eager attention for a model that soft-caps attention logits (Gemma-2) unless
    the caller chose one: some transformers versions load such a model with SDPA, which skips the cap."""
    if "attn_implementation" in model_kwargs:
        return model_kwargs
    config = AutoConfig.from_pretrained(base, trust_remote_code=model_kwargs.get("trust_remote_code", False))
    if getattr(config, "attn_logit_softcapping", None) is None:
        return model_kwargs
    return {**model_kwargs, "attn_implementation": "eager"}


def _name_from_path(source, index: int) -> str:
    name = Path(str(source).rstrip("/")).name.replace(".", "_") or f"expert_{index}"
    return name if name != "__base__" else f"expert_{index}"
