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
