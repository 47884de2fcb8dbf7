"""Two full experts composed with tensor_parallel_size=2 on vLLM's CPU backend: the same greedy tokens as ComposedLM.

The CPU backend binds each worker's threads to a NUMA node, and this machine has one; with the threads bound by
hand (`VLLM_CPU_OMP_THREADS_BIND="0|1"`, one core per worker) both workers start. Without it vLLM refuses with
"Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers". LoRA experts stay at tensor_parallel_size 1
(the model refuses them, integrations/vllm/composite_model.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from vllm import SamplingParams
from vllm_engines import prompts, start_engine, stop_engine

from mergecompose.composition import ComposedLM

MAX_NEW_TOKENS = 16


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor_parallel_size=2 binds one core per worker")
def test_full_experts_at_tensor_parallel_size_2_give_the_composed_tokens(
    monkeypatch, composed_folders, component_folders
):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    requests = prompts(4)
    engine = start_engine(composed_folders["full"], tensor_parallel_size=2)
    try:
        outputs = engine.generate(
            [{"prompt_token_ids": prompt} for prompt in requests],
            SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0),
            use_tqdm=False,
        )
    finally:
        stop_engine(engine)
    got = [list(output.outputs[0].token_ids) for output in outputs]
    experts = [str(component_folders["full_a"]), str(component_folders["full_b"])]
    with ComposedLM.from_pretrained(str(component_folders["base"]), experts) as reference:
        expected = []
        for prompt in requests:
            ids = torch.tensor([prompt])
            out = reference.generate(ids, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=2, pad_token_id=0)
            expected.append(out[0, len(prompt) :].tolist())
    assert got == expected
