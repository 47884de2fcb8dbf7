"""What the `ComposedLM` constructors check and load: expert names, tokenizers, checkpoints and adapters on disk."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from mergecompose.composition.rule import check_weights
from mergecompose.composition.vocabulary import check_saved_tensors_fit, checkpoint_vocabulary
from mergecompose.core.adapters import (
    check_adapter_fits_checkpoint,
    check_adapter_names,
    merged_adapter_model,
    warn_if_made_for_another_base,
)
from mergecompose.core.boundary import check_checkpoint, check_model_or_adapter

# How `from_adapters` runs the LoRA experts in one batched pass (`SharedAdapters`).
LORA_IMPLEMENTATIONS = ("stacked", "peft")


def is_adapter_source(source: str | os.PathLike[str], argument: str = "source") -> bool:
    """True if `source` (a local folder or hub id) holds a peft adapter rather than a full model.

    A missing local folder, one that is neither, or one whose files do not check out (a truncated
    weights file, an unparsable config) raises a ValueError naming `argument`
    (`mergecompose.core.boundary.check_model_or_adapter`).
    """
    return check_model_or_adapter(source, argument) == "adapter"


def check_names(names: object, num_experts: int) -> list[str]:
    """Return `names` as a list after checking: one per expert, non-empty strings, unique."""
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise ValueError(f"`names` must be a list or tuple of {num_experts} expert names, got {names!r}")
    given = list(names)
    if len(given) != num_experts:
        raise ValueError(f"`names` must hold one name per expert ({num_experts}), got {len(given)}: {given!r}")
    for name in given:
        if not isinstance(name, str) or not name:
            raise ValueError(f"`names` must be non-empty strings, got {name!r} in {given!r}")
    repeated = sorted({name for name in given if given.count(name) > 1})
    if repeated:
        raise ValueError(f"`names` must be unique, got {repeated} more than once in {given!r}")
    return given


def check_adapter_arguments(adapters: object, names: Sequence[str] | None, lora_implementation: str) -> None:
    """`from_adapters`' arguments: a non-empty mapping of adapters, names that are its keys, a known implementation."""
    if not isinstance(adapters, Mapping) or len(adapters) == 0:
        raise ValueError(f"`adapters` must be a non-empty mapping of name -> adapter, got {adapters!r}")
    if names is not None and check_names(names, len(adapters)) != list(adapters):
        raise ValueError(
            f"`names` must be left out or equal the keys of `adapters` in order, {list(adapters)}, "
            f"got {list(names)}; the keys already name the experts"
        )
    if lora_implementation not in LORA_IMPLEMENTATIONS:
        raise ValueError(
            f"`lora_implementation` must be one of {list(LORA_IMPLEMENTATIONS)}, got {lora_implementation!r}"
        )


def names_from_paths(experts: Sequence[str | os.PathLike[str]]) -> list[str]:
    """Default expert names: the folder names, made unique with the index if they repeat."""
    names = [_name_from_path(expert, index) for index, expert in enumerate(experts)]
    if len(set(names)) != len(names):
        names = [f"{name}_{index}" for index, name in enumerate(names)]
    return names


def check_tokenizers(tokenizers: object, n_components: int) -> Any:
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
        difference = vocab_difference(tokenizer, tokenizers[0])
        if difference:
            raise ValueError(
                f"tokenizer mismatch: the tokenizer of expert {index} differs from the base's: {difference}"
            )
    return tokenizers[0]


def vocab_difference(tokenizer: PreTrainedTokenizerBase, reference: PreTrainedTokenizerBase) -> str:
    """How `tokenizer`'s vocabulary differs from `reference`'s, in words ("" if they are the same)."""
    vocab, reference_vocab = tokenizer.get_vocab(), reference.get_vocab()
    if vocab == reference_vocab:
        return ""
    differing = sorted(set(vocab.items()) ^ set(reference_vocab.items()))[:5]
    return f"{len(vocab)} tokens against {len(reference_vocab)}; first differing (token, id) pairs: {differing}"


def load_tokenizer(source: str | os.PathLike[str]) -> PreTrainedTokenizerBase | None:
    """The tokenizer saved with a checkpoint, or None if it has none."""
    try:
        return AutoTokenizer.from_pretrained(source)
    except Exception:  # noqa: BLE001 - a checkpoint without a tokenizer is valid
        return None


def attention_that_caps(base: str | os.PathLike[str], model_kwargs: dict[str, Any]) -> dict[str, Any]:
    """`model_kwargs`, with eager attention for a model that soft-caps attention logits (Gemma-2) unless
    the caller chose one: some transformers versions load such a model with SDPA, which skips the cap."""
    if "attn_implementation" in model_kwargs:
        return model_kwargs
    config = AutoConfig.from_pretrained(base, trust_remote_code=model_kwargs.get("trust_remote_code", False))
    if getattr(config, "attn_logit_softcapping", None) is None:
        return model_kwargs
    return {**model_kwargs, "attn_implementation": "eager"}


def load_experts(
    base: str | os.PathLike[str],
    experts: Sequence[str | os.PathLike[str]],
    is_adapter: Sequence[bool],
    model_kwargs: dict[str, Any],
    base_tokenizer: PreTrainedTokenizerBase | None,
) -> tuple[list[PreTrainedModel], list[PreTrainedTokenizerBase] | PreTrainedTokenizerBase | None]:
    """Each expert as a full model in eval mode, and the tokenizers to compose with.

    An adapter is merged into its own copy of the base (`merge_and_unload`) and has the base's tokenizer.
    The tokenizers are one per component, base first, if each has one (`ComposedLM` checks that they
    agree); else the first there is, or None."""
    expert_models: list[PreTrainedModel] = []
    tokenizers = [base_tokenizer]
    for index, (expert, adapter) in enumerate(zip(experts, is_adapter)):
        if adapter:
            fresh_base = AutoModelForCausalLM.from_pretrained(base, **model_kwargs)
            merged = merged_adapter_model(fresh_base, expert, f"experts[{index}]")
            expert_models.append(cast(PreTrainedModel, merged).eval())  # `merge_and_unload` gives the base's class
            tokenizers.append(base_tokenizer)
        else:
            expert_models.append(AutoModelForCausalLM.from_pretrained(expert, **model_kwargs).eval())
            tokenizers.append(load_tokenizer(expert))
    known = [tokenizer for tokenizer in tokenizers if tokenizer is not None]
    if len(known) == len(tokenizers):
        return expert_models, known
    return expert_models, (known[0] if known else None)


def _name_from_path(source: str | os.PathLike[str], index: int) -> str:
    name = Path(str(source).rstrip("/")).name.replace(".", "_") or f"expert_{index}"
    return name if name != "__base__" else f"expert_{index}"


@dataclass(frozen=True)
class PretrainedSources:
    """What `ComposedLM.from_pretrained` loads, checked: the base folder, which experts are adapters, their names,
    the base's tokenizer and the keyword arguments of `from_pretrained`."""

    base: str
    is_adapter: list[bool]
    names: list[str]
    tokenizer: PreTrainedTokenizerBase | None
    model_kwargs: dict[str, Any]


def check_pretrained_sources(
    base: str | os.PathLike[str],
    experts: Sequence[str | os.PathLike[str]],
    weights: Sequence[float] | None,
    names: Sequence[str] | None,
    lora_implementation: str,
    model_kwargs: dict[str, Any],
) -> PretrainedSources:
    """Everything `ComposedLM.from_pretrained` checks before any weights load (its docstring says what)."""
    if len(experts) == 0:
        raise ValueError("`experts` must name at least one checkpoint or adapter, got none")
    check_weights(weights, len(experts))
    base = check_checkpoint(base, "base", adapter_hint="give its base as `base` and the adapter as an expert")
    is_adapter = [is_adapter_source(expert, f"experts[{index}]") for index, expert in enumerate(experts)]
    names = check_names(names_from_paths(experts) if names is None else names, len(experts))
    if all(is_adapter):
        check_adapter_names(names)
        check_adapter_arguments(dict(zip(names, experts)), None, lora_implementation)
    tokenizer = load_tokenizer(base)
    checkpoint_vocabulary(base, experts, is_adapter, tokenizer, model_kwargs.get("trust_remote_code", False))
    for index, (expert, adapter) in enumerate(zip(experts, is_adapter)):
        if adapter:
            check_saved_tensors_fit(base, expert, f"experts[{index}]")
            check_adapter_fits_checkpoint(expert, base, names[index])
            warn_if_made_for_another_base(expert, base, f"experts[{index}]")
    return PretrainedSources(str(base), is_adapter, list(names), tokenizer, attention_that_caps(base, model_kwargs))
