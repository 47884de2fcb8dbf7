"""Shapes of the random models the benchmarks build, apart from `benchmarks.decode` so that the GPU scripts
import little beyond torch, transformers, peft and `mergecompose.composition`."""

from __future__ import annotations

from transformers import Gemma2Config

# google/gemma-2-2b's shape: 26 layers, hidden 2304, 8 heads (4 KV) of 256, MLP 9216, vocab 256000.
GEMMA_2_2B = dict(
    vocab_size=256000,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    max_position_embeddings=8192,
    sliding_window=4096,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    query_pre_attn_scalar=256,
)


def gemma2_2b_config() -> Gemma2Config:
    """A `Gemma2Config` of `GEMMA_2_2B`'s shape, with Gemma's special ids."""
    return Gemma2Config(**GEMMA_2_2B, bos_token_id=2, eos_token_id=1, pad_token_id=0, initializer_range=0.02)
