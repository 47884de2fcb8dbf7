"""Session-scoped tiny random models (hidden 32, 2 layers, vocab 64) used by every test."""

from __future__ import annotations

import pytest
import torch

from mergecompose.core.tiny import random_llama, random_lora_adapter, tiny_llama_config

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules that train tiny models: one torch thread is fastest, and much faster on a loaded machine.

    Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_config():
    return tiny_llama_config()


@pytest.fixture(scope="session")
def base_model(tiny_config):
    return random_llama(tiny_config, seed=0)


@pytest.fixture(scope="session")
def expert_models(tiny_config):
    return [random_llama(tiny_config, seed=1), random_llama(tiny_config, seed=2)]


@pytest.fixture(scope="session")
def lora_dirs(base_model, tmp_path_factory):
    """Two random LoRA adapters for `base_model`, saved as peft folders."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "ab": random_lora_adapter(base_model, root / "ab", seed=11),
        "cd": random_lora_adapter(base_model, root / "cd", seed=12, target_modules=["q_proj", "v_proj", "down_proj"]),
    }


@pytest.fixture(scope="session")
def checkpoints(base_model, expert_models, tmp_path_factory):
    """`base_model` and `expert_models` saved as safetensors checkpoint folders: base/, expert_0/, expert_1/."""
    root = tmp_path_factory.mktemp("checkpoints")
    base_model.save_pretrained(root / "base")
    for index, model in enumerate(expert_models):
        model.save_pretrained(root / f"expert_{index}")
    return root
