"""ComposedLM: a base causal LM and k experts composed at every decoding step.

The components run behind one interface (`Backend`, backend.py): k+1 full models, one KV cache each
(`SeparateModels`), or k LoRA adapters on one base, every component in one pass (`SharedAdapters`).
`generate` decodes through generation.py: the options checked once (`DecodingConfig`), the prompt prepared
(inputs.py), then the plain decoding loop (sampling.py) or, with a draft, the speculative one
(speculative/decoding.py).

`close()` (or leaving a `with` block) gives the caller's base model back as it was.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.streamers import BaseStreamer

from mergecompose.composition.architecture import check_vocabularies, context_length
from mergecompose.composition.backend import Backend
from mergecompose.composition.decoding_config import DecodingConfig
from mergecompose.composition.generation import generate_composed
from mergecompose.composition.inputs import check_context, checked_logprobs, prepare_inputs
from mergecompose.composition.kernels.stopwatch import Stopwatch
from mergecompose.composition.loading import (
    PretrainedSources,
    check_adapter_arguments,
    check_names,
    check_pretrained_sources,
    check_tokenizers,
    load_experts,
)
from mergecompose.composition.remedies import compose_with_remedies
from mergecompose.composition.rule import check_weights
from mergecompose.composition.separate_models import SeparateModels
from mergecompose.composition.shared_adapters import SharedAdapters
from mergecompose.composition.speculative.decoding import SpeculationStats
from mergecompose.composition.speed_choices import SpeedChoices
from mergecompose.composition.vocabulary import with_vocabulary
from mergecompose.core.adapters import warn_if_made_for_another_base

_CLOSED = "this ComposedLM was closed and has given its models back; build a new one to compose again"


# Inference mode: a composition's passes run outside `torch.inference_mode` even when the caller is inside it
# (under `no_grad`: no graph is built either way). Inference tensors have no version counter, and without one the
# shared base's sibling linears cannot tell that they read one input unchanged, so each would compute its group's
# whole packed product (kernels/packed_weights.py, `reads_same`): q/k/v's three times; on SmolLM2 at batch 8 that
# ran at 0.61× transformers' `generate`, against 0.88× outside it. The caller's inference tensors are read, never
# changed; what `generate` returns is an ordinary tensor.


class ComposedLM:
    """Probability-space composition of a base causal LM and k experts sharing one vocabulary.

    At every position, `log p̂ = log p_b + Σ_i w_i (log p_i − log p_b)`, renormalised
    (Kumar, Bucarelli & Natale, 2026; see `compose_logprobs`). Optional `remedies` (the built-ins of
    `mergecompose.composition.remedies`, or any object of the protocol of `remedy_phases`) change the rule at
    every step, phase by phase; see `compose_with_remedies`.

    `close()`, or leaving a `with ComposedLM...(...) as lm:` block, gives the models back as
    they were (see `from_adapters`); the ComposedLM cannot be used afterwards.

    Args:
        base_model: a transformers causal LM.
        expert_models: k causal LMs with the base's vocabulary. Checkpoints with padded rows (embeddings resized
            to a multiple of 64) compose over the vocabulary they share, when every id of the tokenizer lies
            below it: the padded ids are ruled out (log-prob −inf) and each component renormalises over the
            shared ids; the models with more rows are replaced by views cut to it (`with_vocabulary`, nothing
            copied, the given models unchanged). Any other size mismatch is refused naming both sizes.
        weights: k exponents, default 1.0 each.
        tokenizers: optional tokenizers, one per component (base first) or a single one for all;
            when several are given their vocabularies must agree.
        remedies: rule changes applied at every step, in their phases' order, in the order given within one.
        names: k unique, non-empty expert names (`expert_names`); default `expert_0`, `expert_1`, ...
    """

    _backend: Backend | None

    def __init__(
        self,
        base_model: PreTrainedModel,
        expert_models: Sequence[PreTrainedModel],
        weights: Sequence[float] | None = None,
        tokenizers: PreTrainedTokenizerBase | Sequence[PreTrainedTokenizerBase] | None = None,
        remedies: Sequence[object] = (),
        *,
        names: Sequence[str] | None = None,
    ) -> None:
        if len(expert_models) == 0:
            raise ValueError("`expert_models` must hold at least one model, got an empty sequence")
        if names is None:
            names = [f"expert_{index}" for index in range(len(expert_models))]
        self._configure(base_model, len(expert_models), names, weights, tokenizers, remedies)
        vocabulary = check_vocabularies(base_model, expert_models, self.tokenizer)
        self._backend = SeparateModels([with_vocabulary(model, vocabulary) for model in [base_model, *expert_models]])

    def _configure(
        self,
        base_model: PreTrainedModel,
        num_experts: int,
        names: Sequence[str],
        weights: Sequence[float] | None,
        tokenizers: object,
        remedies: Sequence[object],
    ) -> None:
        """Check and set everything but the backend, so that bad arguments fail before any model is touched."""
        self.expert_names = check_names(names, num_experts)
        self.num_experts = num_experts
        self.weights = check_weights(weights, num_experts)
        self.tokenizer: PreTrainedTokenizerBase | None = check_tokenizers(tokenizers, num_experts + 1)
        self.generation_config: GenerationConfig | None = getattr(base_model, "generation_config", None)
        self.remedies = tuple(remedies)
        self._backend = None
        self._closed = False
        self._merged_drafts: dict[tuple[float, ...], PreTrainedModel] = {}
        # LoRA experts on one base without remedies: `generate` may mix the last hidden states before the shared
        # output layer (kernels/mixed_head.py), equal to the rule up to float rounding. None (default): where that is
        # faster on this machine, timed on the first call at each batch size (`speed_choices`); True: always; False:
        # never, every component's logits are computed.
        self.mix_before_head: bool | None = None
        self.stopwatch = Stopwatch()  # what times the mixed head's trial
        self._speed = SpeedChoices()  # what the timings chose, kept across calls
        # What the last `generate(draft=...)` did (None after a call without a draft).
        self.speculation_stats: SpeculationStats | None = None

    @classmethod
    def from_adapters(
        cls,
        base_model: PreTrainedModel,
        adapters: Mapping[str, object],
        weights: Sequence[float] | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        lora_implementation: str = "stacked",
        remedies: Sequence[object] = (),
        *,
        names: Sequence[str] | None = None,
        pack_weights: bool | None = None,
    ) -> ComposedLM:
        """Load several peft LoRA adapters onto one copy of `base_model`.

        `adapters` maps a name to an adapter folder, a hub id, or a `PeftModel` whose active
        adapter is taken. Its keys are the expert names; `names` may be left out, and if given must
        equal the keys in order (so that code passing `names=` works for every constructor).

        No copy of the base weights is made: `base_model` itself is changed in place (with
        "stacked", the forward of each of its `nn.Linear` is replaced by one that adds the LoRA
        products inside this object's forward passes only; with "peft", LoRA layers are injected
        into it), frozen and put in eval mode. With "stacked" on a CPU, the float32 weights of its
        decoder linears may meanwhile be held in oneDNN's packed layout (kernels/few_row_linear.py): the parameters
        keep their identity but hold empty tensors, `state_dict()` gives the dense weights. `pack_weights` None
        (default) packs them if their products over a decoding step's rows run faster packed on this machine,
        timed at load (`speed_choices` says what was chosen); True always packs where oneDNN can, False never.
        `close()`
        (or leaving a `with` block) undoes all of it: same modules, parameters, flags and outputs as
        before, the weights bit for bit. `lora_implementation` picks
        how the experts run in one batched pass (see `SharedAdapters`); "stacked" falls back to
        "peft" for what it does not support (DoRA, LoRA on embeddings).

        An adapter whose recorded base (`base_model_name_or_path`) clearly names another model than
        `base_model` (its `name_or_path`) gets a UserWarning naming both, before anything is injected
        (`mergecompose.core.adapters.is_other_base`); nothing recorded, nothing said.
        """
        check_adapter_arguments(adapters, names, lora_implementation)
        if pack_weights not in (None, True, False):
            raise ValueError(f"`pack_weights` must be True, False or None (measure), got {pack_weights!r}")
        for name, adapter in adapters.items():
            warn_if_made_for_another_base(adapter, base_model, f"adapters[{name!r}]")
        return cls._on_shared_base(
            base_model, adapters, weights, tokenizer, lora_implementation, remedies, pack_weights
        )

    @classmethod
    def _on_shared_base(
        cls,
        base_model: PreTrainedModel,
        adapters: Mapping[str, object],
        weights: Sequence[float] | None,
        tokenizer: PreTrainedTokenizerBase | None,
        lora_implementation: str,
        remedies: Sequence[object],
        pack_weights: bool | None = None,
    ) -> ComposedLM:
        """`from_adapters` after its checks."""
        self = cls.__new__(cls)
        self._configure(base_model, len(adapters), list(adapters), weights, tokenizer, remedies)
        self._backend = SharedAdapters(base_model, adapters, lora_implementation, pack_weights)
        return self

    @classmethod
    def from_pretrained(
        cls,
        base: str | os.PathLike[str],
        experts: Sequence[str | os.PathLike[str]],
        weights: Sequence[float] | None = None,
        remedies: Sequence[object] = (),
        *,
        names: Sequence[str] | None = None,
        lora_implementation: str = "stacked",
        **model_kwargs: Any,
    ) -> ComposedLM:
        """Load a base and experts from local folders or hub ids.

        An expert folder with `adapter_config.json` is a peft adapter; anything else is a full
        checkpoint. All adapters: one shared base (`from_adapters`). All full checkpoints: one
        model each. A mix: each adapter is merged into its own copy of the base
        (`merge_and_unload`), since the shared-base path needs every expert to be an adapter.

        `names` default to the folder names (made unique with the index if they repeat); with
        all adapters they must also be valid peft adapter names.

        Before any weights load: config.json's `vocab_size` of the base and each full expert, against the
        base's tokenizer, decides the vocabulary (see the class docstring: padded rows beyond the tokenizer
        are ruled out, any other mismatch is refused naming the checkpoint and both sizes); an adapter that
        saves resized embeddings (`modules_to_save`) is refused naming both sizes (`check_saved_tensors_fit`);
        and one whose recorded base clearly names another model than `base` gets a UserWarning (see
        `from_adapters`).
        A full checkpoint records no base it was fine-tuned from: an expert fine-tuned from another model
        of the same shapes and vocabulary cannot be detected.
        """
        sources = check_pretrained_sources(base, experts, weights, names, lora_implementation, model_kwargs)
        return cls.from_checked_sources(sources, experts, weights, remedies, lora_implementation=lora_implementation)

    @classmethod
    def from_checked_sources(
        cls,
        sources: PretrainedSources,
        experts: Sequence[str | os.PathLike[str]],
        weights: Sequence[float] | None = None,
        remedies: Sequence[object] = (),
        *,
        lora_implementation: str = "stacked",
    ) -> ComposedLM:
        """`from_pretrained` after its checks: `sources` from `check_pretrained_sources` for the same arguments."""
        base_model = AutoModelForCausalLM.from_pretrained(sources.base, **sources.model_kwargs).eval()
        tokenizer, names = sources.tokenizer, sources.names
        if all(sources.is_adapter):
            adapters = dict(zip(names, experts))
            return cls._on_shared_base(base_model, adapters, weights, tokenizer, lora_implementation, remedies)
        models, tokenizers = load_experts(sources.base, experts, sources.is_adapter, sources.model_kwargs, tokenizer)
        return cls(base_model, models, weights, tokenizers, remedies=remedies, names=names)

    def close(self) -> None:
        """Give the caller's models back as they were; idempotent.

        For `from_adapters`: the LoRA layers or patched forwards are removed from the base model
        and its train/eval modes and `requires_grad` flags restored, so its modules, parameters and
        outputs are bitwise what they were. For full checkpoints, the replaced forwards of their linears
        (the few-row kernel, `SeparateModels`) are removed. Afterwards this ComposedLM raises on use.
        """
        if self._closed:
            return
        self.backend.close()
        self._backend = None  # drop the references to the models
        self._merged_drafts = {}
        self._closed = True

    def __enter__(self) -> ComposedLM:
        self._check_open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(_CLOSED)

    @property
    def backend(self) -> Backend:
        """What runs the components (backend.py)."""
        if self._backend is None:
            raise RuntimeError(_CLOSED)
        return self._backend

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
        ids, mask, positions = prepare_inputs(input_ids, attention_mask, position_ids, self.vocab_size, self.device)
        check_context(positions, f"the input ({ids.shape[1]} tokens a row)", self.context_length)
        with torch.inference_mode(False):  # "Inference mode" above `ComposedLM`
            logits = self.backend.forward(ids, mask, positions)  # (k+1, B, T, V)
        return checked_logprobs(logits, ["base", *self.expert_names])

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

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        config: DecodingConfig | None = None,
        *old_positional: Any,
        position_ids: torch.Tensor | None = None,
        generated_position_ids: torch.Tensor | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        streamer: BaseStreamer | None = None,
        **options: Any,
    ) -> torch.Tensor:
        """Decode from the composed distribution; returns `(B, T + n)`, the prompt and n ≤ max_new_tokens tokens.

        `input_ids` `(B, T)`, left-padded where rows differ in length (`attention_mask` 0 on the left). The
        decoding options are the fields of a `DecodingConfig`, whose docstring says what each does: `config`, and
        keyword `options` that replace its fields (`max_new_tokens=8`, `do_sample=True`, `draft="merged"`, …);
        all are checked before any model runs. A row finishes at its EOS or stop string (that token kept, pad
        after it); decoding ends when every row has finished or after `max_new_tokens`. With a `draft`,
        `speculation_stats` says what happened.

        Not decoding options: `position_ids` `(B, T)` and `generated_position_ids` `(B, max_new_tokens)`, the
        positions of the prompt and of each generated token (inputs of the model; default each row's token count,
        left padding skipped, then one more per token); `tokenizer` (default this ComposedLM's), which matches
        `stop_strings`; `streamer`, transformers' `TextStreamer` or any `BaseStreamer`, for one row: `put` the
        prompt, then the new tokens as they are decided, and `end()`. Options passed by position
        (`generate(ids, mask, 32, False)`) still work for one release, with a DeprecationWarning.
        """
        # Every tensor of the passes with a version counter ("Inference mode" above `ComposedLM`).
        with torch.inference_mode(False):
            self._check_open()
            self.speculation_stats = None
            inputs = {"position_ids": position_ids, "generated_position_ids": generated_position_ids}
            sequences, self.speculation_stats = generate_composed(
                self,
                input_ids,
                attention_mask,
                (config, old_positional, options, inputs),
                tokenizer,
                streamer,
                self._mixes_before_head,
                self._speed.draft_kernel,
            )
            return sequences

    def _mixes_before_head(self, batch: int) -> bool:
        """Whether `generate` mixes the last hidden states before one output layer pass: never with remedies, else
        as `mix_before_head` says or timing chooses (`SpeedChoices.mixes_before_head`)."""
        return not self.remedies and self._speed.mixes_before_head(
            self.backend, self.mix_before_head, batch, self.weights, self.num_experts, self.stopwatch
        )

    @property
    def speed_choices(self) -> dict[str, object]:
        """What the timings on this machine chose so far, with each option's best time in ms: whether the shared
        base's weights are packed (at load), the few-row kernel by row count, and mixing before the output layer by
        batch size (on the first `generate` at that size). Choices fixed by an argument or not made are left out."""
        return self._speed.report(self.backend)

    def merged_draft(self, draft_lambda: Sequence[float] | None = None) -> PreTrainedModel:
        """The task-arithmetic merge of this composition's experts, θ_b + Σ_i λ_i (θ_i − θ_b), as a model.

        λ_i defaults to the composition's weights w_i. Full experts are merged tensor by tensor
        (`mergecompose.merging.merge`, speculative/drafts.py); LoRA experts add λ_i ΔW_i to a copy of the
        base (`merged_lora_draft`). Tensors the merge leaves unchanged are shared with the base.
        Built once per λ and kept until `close()`."""
        self._check_open()
        lambdas = tuple(self.weights or [1.0] * self.num_experts) if draft_lambda is None else tuple(draft_lambda)
        if lambdas not in self._merged_drafts:
            self._merged_drafts[lambdas] = self.backend.merged_draft(lambdas)
        return self._merged_drafts[lambdas]
