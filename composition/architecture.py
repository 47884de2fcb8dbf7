"""What the composition reads off a transformers causal LM: its vocabulary, its context, how it takes a cache,
and which attention mask a pass over several tokens can give it."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from mergecompose.composition.vocabulary import shared_vocabulary, tokenizer_size

# Config fields that hold the number of positions a model was built for, in the order looked up.
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx")


def vocab_size(model: PreTrainedModel) -> int:
    """The size of the model's output distribution (rows of the output embedding)."""
    output_embeddings = model.get_output_embeddings()
    if output_embeddings is not None and hasattr(output_embeddings, "weight"):
        return int(output_embeddings.weight.shape[0])
    return int(model.config.vocab_size)


def check_vocabularies(
    base_model: PreTrainedModel, expert_models: Sequence[PreTrainedModel], tokenizer: object = None
) -> int:
    """The vocabulary the composition runs over (`shared_vocabulary`): the base's, or, when some models carry
    padded rows beyond every id of `tokenizer`, the smallest size; else a ValueError names both sizes."""
    sizes = [("`base_model`", vocab_size(base_model))]
    sizes += [(f"`expert_models[{index}]`", vocab_size(expert)) for index, expert in enumerate(expert_models)]
    return shared_vocabulary(sizes, tokenizer_size(tokenizer))


def context_length(model: torch.nn.Module) -> int | None:
    """The number of positions the model was built for (`max_position_embeddings` or a synonym), or None."""
    return config_context_length(getattr(model, "config", None))


def config_context_length(config: object) -> int | None:
    """The number of positions a model's config says it was built for (`context_length` before it loads)."""
    for name in _CONTEXT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def cache_kwarg(model: torch.nn.Module) -> str:
    """transformers renamed `past_key_values` to `cache` during 5.x; pass whichever is native."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def has_sliding_window(model: torch.nn.Module) -> bool:
    """Whether the model's config sets a sliding attention window (Gemma-2, Mistral, ...): it counts cache columns."""
    return bool(getattr(getattr(model, "config", None), "sliding_window", None))


def bias_dtype(models: Sequence[PreTrainedModel]) -> torch.dtype | None:
    """The dtype of a 4D additive attention mask these models all take as given, or None (pass the 2D mask):
    eager or SDPA attention, no sliding window (a 4D mask would replace the window), one dtype."""
    dtypes = {model.dtype for model in models}
    if len(dtypes) == 1 and all(
        getattr(model.config, "_attn_implementation", None) in ("eager", "sdpa") and not has_sliding_window(model)
        for model in models
    ):
        return dtypes.pop()
    return None
