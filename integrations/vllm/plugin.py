"""vLLM's plugin entry point (`vllm.general_plugins` in pyproject.toml): registers the composite architecture.

vLLM calls `register()` in every process it starts, possibly more than once. The model class is
registered by its import path, so `integrations.vllm.composite_model` (which imports vLLM) is only imported when
vLLM builds a composite model; installing mergecompose without vLLM costs nothing.
"""

from __future__ import annotations

# The `architectures` entry of a model folder written by `mergecompose.integrations.vllm.folder.build_vllm_model`.
ARCHITECTURE = "MergeComposeForCausalLM"
MODEL_CLASS = "mergecompose.integrations.vllm.composite_model:ComposedForCausalLM"


def register() -> None:
    from vllm import ModelRegistry  # lazy: this module is imported without vLLM too

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
