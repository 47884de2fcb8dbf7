"""vLLM's plugin entry point (`vllm.general_plugins` in pyproject.toml): registers the composite architecture.

vLLM calls `register()` in every process it starts, possibly more than once. The model class is
registered by its import path, so `integrations.vllm.composite_model` (which imports vLLM) is only imported when
vLLM builds a composite model; installing mergecompose without vLLM costs nothing. `register()` also gives vLLM the
composite architecture's config hook, which adds the logits processor that carries each request's experts
(`integrations.vllm.requests`).
"""

from __future__ import annotations

# The `architectures` entry of a model folder written by `mergecompose.integrations.vllm.folder.build_vllm_model`.
ARCHITECTURE = "MergeComposeForCausalLM"
MODEL_CLASS = "mergecompose.integrations.vllm.composite_model:ComposedForCausalLM"


def register() -> None:
    # lazy: this module is imported without vLLM too
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from mergecompose.integrations.vllm.requests import ComposedConfig

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    # vLLM's per-architecture config hook: adds the logits processor of per-request experts to a composite model's
    # engine, and to no other (integrations/vllm/requests.py).
    MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, ComposedConfig)  # type: ignore[arg-type]
