"""vLLM's plugin entry point (`vllm.general_plugins` in pyproject.toml): registers the composite architecture.

vLLM calls `register()` in every process it starts, possibly more than once. The model class is
registered by its import path, so `integrations.vllm.composite_model` (which imports vLLM) is only imported when
vLLM builds a composite model; installing mergecompose without vLLM costs nothing. `register()` also gives vLLM the
composite architecture's config hook, `ComposedConfig`, which adds the logits processor that carries each request's
experts (`integrations.vllm.requests`, by its import path too) to a composite model's engine, and to no other.
"""

from __future__ import annotations

import logging

# The `architectures` entry of a model folder written by `mergecompose.integrations.vllm.folder.build_vllm_model`.
ARCHITECTURE = "MergeComposeForCausalLM"
MODEL_CLASS = "mergecompose.integrations.vllm.composite_model:ComposedForCausalLM"
# The logits processors of per-request experts, for vLLM's V1 and V2 model runners.
PROCESSOR = "mergecompose.integrations.vllm.requests:ExpertChoice"
PROCESSOR_V2 = "mergecompose.integrations.vllm.requests:ExpertChoiceV2"
# The expert names of the composite folder whose engine config this process built last: `validate_params`, which
# vLLM runs in the server's process with the request's parameters alone, checks a request's names against them.
SERVED_EXPERTS: list[str] = []

logger = logging.getLogger(__name__)


class ComposedConfig:
    """vLLM's per-architecture config hook (`MODELS_CONFIG_MAP`, run by `VllmConfig.__post_init__`) for the
    composite architecture: adds the logits processor of per-request experts and records the folder's names."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        composition = getattr(vllm_config.model_config.hf_config, "composition", None)
        if not isinstance(composition, dict):
            return  # the model itself refuses a folder without its composition
        SERVED_EXPERTS[:] = [expert["name"] for expert in composition["experts"]]
        if vllm_config.speculative_config is not None:
            # vLLM refuses custom logits processors with speculative decoding (`build_logitsprocs`).
            logger.warning("per-request `experts` are not read under speculative decoding: the folder's weights serve")
            return
        processor = PROCESSOR_V2 if vllm_config.use_v2_model_runner else PROCESSOR
        processors = list(vllm_config.model_config.logits_processors or [])
        if processor not in processors:
            vllm_config.model_config.logits_processors = [*processors, processor]

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        return


def register() -> None:
    # lazy: this module is imported without vLLM too
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, ComposedConfig)  # type: ignore[arg-type]
