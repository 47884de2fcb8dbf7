"""GGUF checkpoints as ordinary Hugging Face folders: `mergecompose convert-gguf` and `mergecompose fetch-model`."""
