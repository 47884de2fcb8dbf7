"""Fixtures of the vLLM tests, which run in the second venv (.venv-vllm, `make test`), not in the main one.

vLLM's CPU attention needs head_dim >= 32, so these models are wider than the main suite's: hidden 64,
2 heads (head_dim 32), 2 layers, vocabulary 64 (the 4 special tokens of `mergecompose.analysis.data.char_tokenizer`
and 60 letters and digits). One `vllm.LLM` per test module (`vllm_engine`), since each takes a while to start.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

# Without vLLM (the main venv) this folder is not collected; `make test` runs it again in .venv-vllm.
# A folder named vllm on sys.path would be found as a namespace package `vllm` (no origin):
# only a real package counts.
_VLLM = importlib.util.find_spec("vllm")
if _VLLM is None or _VLLM.origin is None:
    collect_ignore_glob = ["test_*.py"]
else:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes most of the RAM
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: each engine starts sooner

    import torch
    from vllm_engines import VOCAB

    from benchmarks.lm_eval import benchmark_characters
    from mergecompose.analysis.data import char_tokenizer
    from mergecompose.core.tiny import random_llama, random_lora_adapter, tiny_llama_config
    from mergecompose.integrations.vllm.folder import build_vllm_model

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def vllm_test_config():
    return tiny_llama_config(vocab_size=VOCAB, hidden_size=64, num_heads=2, initializer_range=0.35)


@pytest.fixture(scope="session")
def component_folders(tmp_path_factory):
    """{"base", "full_a", "full_b", "lora_a", "lora_b"} -> folder; the base folder has the tokenizer."""
    root = tmp_path_factory.mktemp("vllm_components")
    config = vllm_test_config()
    base = random_llama(config, seed=0)
    base.save_pretrained(root / "base")
    tokenizer = char_tokenizer(benchmark_characters(VOCAB - 4))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(root / "base")
    folders = {"base": root / "base"}
    for name, seed in (("full_a", 1), ("full_b", 2)):
        expert = random_llama(config, seed=seed)
        # A fine-tune: the base plus a small change, so that the composition differs from every component.
        with torch.no_grad():
            for own, base_parameter in zip(expert.parameters(), base.parameters()):
                own.mul_(0.3).add_(base_parameter, alpha=0.7)
        expert.save_pretrained(root / name)
        folders[name] = root / name
    folders["lora_a"] = random_lora_adapter(base, root / "lora_a", seed=11, scale=2.0)
    folders["lora_b"] = random_lora_adapter(
        base, root / "lora_b", seed=12, scale=2.0, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]
    )
    return folders


@pytest.fixture(scope="session")
def composed_folders(component_folders, tmp_path_factory):
    """The vLLM model folders: {"full": base + two full experts, "lora": base + two LoRA adapters (weights 1, 0.5)}."""
    root = tmp_path_factory.mktemp("vllm_models")
    folders = component_folders
    return {
        "full": build_vllm_model(root / "full", folders["base"], [folders["full_a"], folders["full_b"]]),
        "lora": build_vllm_model(
            root / "lora", folders["base"], [folders["lora_a"], folders["lora_b"]], weights=[1.0, 0.5]
        ),
    }
