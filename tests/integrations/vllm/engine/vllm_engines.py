"""Helpers of the vLLM tests: prompts, and one engine at a time (start, stop)."""

from __future__ import annotations

import gc

import torch
from vllm import LLM
from vllm.distributed import cleanup_dist_env_and_memory

VOCAB = 64


def prompts(count: int = 8, seed: int = 0) -> list[list[int]]:
    """`count` prompts of token ids (lengths 3 to 17), none with a special token."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 18, (count,), generator=generator).tolist()
    return [torch.randint(4, VOCAB, (length,), generator=generator).tolist() for length in lengths]


def start_engine(model_folder, **options):
    return LLM(model=str(model_folder), dtype="float32", max_model_len=128, enforce_eager=True, seed=0, **options)


def stop_engine(engine: LLM) -> None:
    """Shut the engine down so that the next one can start in this process."""
    engine.llm_engine.engine_core.shutdown()
    gc.collect()
    cleanup_dist_env_and_memory()


# A request's choice of experts (`vllm_xargs`, integrations/vllm/choice.py) and the reference that gives its output:
# ComposedLM of the base with these component folders (conftest.py's names) at these weights.
def greedy_references(component_folders, choices, requests, max_new_tokens):
    """{choice name: [ComposedLM's greedy tokens of each prompt, up to EOS or `max_new_tokens`]} for
    `choices` {name: (expert folder names, weights)}; the base alone is one expert at weight 0."""
    from mergecompose.composition import ComposedLM

    tokens = {}
    for name, (experts, weights) in choices.items():
        folders = [str(component_folders[expert]) for expert in experts]
        with ComposedLM.from_pretrained(str(component_folders["base"]), folders, weights=weights) as composed:
            tokens[name] = []
            for prompt in requests:
                ids = torch.tensor([prompt])
                out = composed.generate(
                    ids,
                    torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=2,
                    pad_token_id=0,
                )
                tokens[name].append(out[0, len(prompt) :].tolist())
    return tokens
