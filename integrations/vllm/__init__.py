"""vLLM: the plugin, the composite model, the folder that serves a composition, and `mergecompose vllm-model`."""
