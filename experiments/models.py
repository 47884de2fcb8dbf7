"""Small transformers causal LMs for the tasks, and the LoRA config of their adapters."""

from __future__ import annotations

import torch
from peft import LoraConfig
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from mergecompose.experiments.compare_config import LoraSettings, ModelSettings


def build_model(settings: ModelSettings, vocab_size: int, pad_id: int, eos_id: int, seed: int) -> PreTrainedModel:
    """A randomly initialised model (seeded): `LlamaForCausalLM` (RoPE) or `GPT2LMHeadModel` (learned positions)."""
    torch.manual_seed(seed)
    if settings.architecture == "llama":
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=settings.hidden_size,
            intermediate_size=settings.intermediate_size or 2 * settings.hidden_size,
            num_hidden_layers=settings.num_layers,
            num_attention_heads=settings.num_heads,
            num_key_value_heads=settings.num_heads,
            max_position_embeddings=settings.max_position_embeddings,
            rope_theta=settings.rope_theta,
            pad_token_id=pad_id,
            bos_token_id=eos_id,
            eos_token_id=eos_id,
            tie_word_embeddings=False,
        )
        return LlamaForCausalLM(config)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_embd=settings.hidden_size,
        n_layer=settings.num_layers,
        n_head=settings.num_heads,
        n_inner=settings.intermediate_size,
        n_positions=settings.max_position_embeddings,
        pad_token_id=pad_id,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )
    return GPT2LMHeadModel(config)


def lora_config(settings: LoraSettings, architecture: str) -> LoraConfig:
    """peft's LoraConfig; "all-linear" adapts every linear layer but the output head (peft's own rule).

    GPT-2's linear layers are `Conv1D` (weight stored transposed), hence `fan_in_fan_out`."""
    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        target_modules=settings.target_modules,
        lora_dropout=0.0,
        bias="none",
        fan_in_fan_out=architecture == "gpt2",
        task_type="CAUSAL_LM",
    )
