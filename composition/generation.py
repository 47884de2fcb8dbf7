"""Decoding from a composition, for `ComposedLM.generate`: the options checked once (`DecodingConfig`), the prompt
prepared (inputs.py), how the rule is computed chosen (every component's logits, or the last hidden states mixed
before one output layer pass, kernels/mixed_head.py), then the plain decoding loop (sampling.py) or, with a draft,
the speculative one (speculative/decoding.py).

`generate_composed` reads the composition through `Composition`, what a `ComposedLM` offers, so that this module
needs nothing of model.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.streamers import BaseStreamer

from mergecompose.composition.backend import Backend
from mergecompose.composition.decoding_config import decoding_arguments
from mergecompose.composition.inputs import prepare_prompt
from mergecompose.composition.kernels.few_row_kernel import FewRowKernel
from mergecompose.composition.kernels.mixed_head import decoding_backend
from mergecompose.composition.sampling import Sampler, TokenStream, sample
from mergecompose.composition.speculative.decoding import SpeculationStats, speculate
from mergecompose.composition.stops import Stopping, special_ids, stop_criteria


class Composition(Protocol):
    """What `generate_composed` reads of a composition: a `ComposedLM`."""

    @property
    def backend(self) -> Backend: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def context_length(self) -> int | None: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def weights(self) -> list[float] | None: ...
    @property
    def remedies(self) -> tuple[object, ...]: ...
    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None: ...
    @property
    def generation_config(self) -> GenerationConfig | None: ...
    def merged_draft(self, draft_lambda: Sequence[float] | None = None) -> PreTrainedModel: ...


def generate_composed(
    lm: Composition,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    arguments: tuple[object, Sequence[object], dict[str, Any], dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase | None,
    streamer: BaseStreamer | None,
    mixes_before_head: Callable[[int], bool],
    draft_kernel: FewRowKernel,
) -> tuple[torch.Tensor, SpeculationStats | None]:
    """`ComposedLM.generate` (whose docstring says what each argument does): the sequences `(B, T + n)`, and with a
    draft what the speculation did (else None). `arguments` are generate's `(config, old positional options,
    keyword options, inputs)` as it got them; `mixes_before_head(batch)` says whether to mix before the output
    layer at that batch size; `draft_kernel` serves the drafts' few-row passes."""
    config, inputs = decoding_arguments(*arguments)
    config.check_draft_fits(lm.num_experts, lm.device, lm.vocab_size, lm.tokenizer, lm.backend.shares_one_base)
    criteria = stop_criteria(config.stop_strings, lm.tokenizer if tokenizer is None else tokenizer)
    prompt = prepare_prompt(
        input_ids,
        attention_mask,
        **inputs,
        max_new_tokens=config.max_new_tokens,
        truncate=config.truncate,
        vocabulary=lm.vocab_size,
        context=lm.context_length,
        device=lm.device,
    )
    stream = TokenStream.check(streamer, prompt.input_ids)
    eos_ids, pad_id = special_ids(
        config.eos_token_id, config.pad_token_id, lm.generation_config, lm.vocab_size, lm.device
    )
    stopping, sampler = Stopping(eos_ids, pad_id, criteria), Sampler.from_config(config, lm.device)
    mix = mixes_before_head(prompt.input_ids.shape[0])  # False unless LoRA experts on one base (can_mix)
    backend, compose = decoding_backend(
        lm.backend, mix, lm.weights, lm.num_experts, lm.remedies, lm.vocab_size, config.do_sample
    )
    stats = None
    try:
        if config.draft is None:
            sequences = sample(backend, compose, prompt, stopping, sampler, stream)
        else:
            draft = lm.merged_draft(config.draft_lambda) if isinstance(config.draft, str) else config.draft
            sequences, stats = speculate(
                backend, draft, draft_kernel, compose, prompt, stopping, sampler, config, stream
            )
    finally:
        if backend is not lm.backend:
            backend.close()  # the output layer's hook
    stream.end()
    return sequences, stats
