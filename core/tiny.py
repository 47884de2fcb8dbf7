"""Tiny random Llama models and LoRA adapters, for the demo, the tests and the benchmarks.

Nothing here downloads: every model is built from a config with a seeded random init.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_llama_config(
    vocab_size: int = 64,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    initializer_range: float = 0.2,
) -> LlamaConfig:
    """A Llama config; a larger-than-usual init keeps random next-token distributions peaked."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        initializer_range=initializer_range,
    )


def random_llama(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def random_lora_adapter(
    base: LlamaForCausalLM,
    out_dir: str | Path,
    seed: int,
    rank: int = 4,
    target_modules: list[str] | None = None,
    scale: float = 1.0,
) -> Path:
    """Save a LoRA adapter with random A and B (so ΔW ≠ 0) for `base` to `out_dir`."""
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=rank,
        target_modules=target_modules or ALL_LINEAR,
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    peft_model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.mul_(scale)
    peft_model.save_pretrained(str(out_dir))
    return Path(out_dir)


EOS = 2  # the end-of-sequence id of the tiny test batches
PAD = 0  # their padding id


def left_padded_batch(lengths: list[int], vocab: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and mask, left-padded with `PAD`, with ids drawn from [3, vocab) (no EOS in prompts)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(3, vocab, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


def task_arithmetic_mergekit_config(checkpoints: Path) -> dict:
    """mergekit's YAML schema: task arithmetic of `checkpoints`' two saved experts (expert_0/, expert_1/ beside
    base/), weight 0.5 each, λ = 0.9."""
    return {
        "merge_method": "task_arithmetic",
        "base_model": str(checkpoints / "base"),
        "models": [{"model": str(checkpoints / f"expert_{i}"), "parameters": {"weight": 0.5}} for i in range(2)],
        "parameters": {"lambda": 0.9},
        "dtype": "float32",
    }
