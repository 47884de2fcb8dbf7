"""Per-request experts (`vllm_xargs` → `SamplingParams.extra_args`, integrations/vllm/requests.py) in one engine of
the LoRA composition, with a small token budget per step (32) and at most 4 requests at once: prompts longer than
the budget are prefilled in chunks, and requests that end at different times make vLLM move rows in the batch."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm_engines import greedy_references, prompts, start_engine, stop_engine

from mergecompose.composition import ComposedLM
from mergecompose.integrations.vllm.requests import request_weights

TOKENS_PER_STEP = 32
# choice name: (the request's extra_args, the reference's experts and weights)
CHOICES = {
    "base": ({"experts": ""}, (["lora_a"], [0.0])),
    "a": ({"experts": "lora_a"}, (["lora_a"], [1.0])),
    "a+b": ({"experts": "lora_a,lora_b", "weights": "1.0,0.5"}, (["lora_a", "lora_b"], [1.0, 0.5])),
    "-b": ({"experts": ["lora_b"], "weights": [-0.5]}, (["lora_b"], [-0.5])),
    "folder": (None, (["lora_a", "lora_b"], [1.0, 0.5])),
}


@pytest.fixture(scope="module")
def engine(composed_folders):
    engine = start_engine(composed_folders["lora"], max_num_batched_tokens=TOKENS_PER_STEP, max_num_seqs=4)
    yield engine
    stop_engine(engine)


def test_each_request_gets_its_own_experts(engine, component_folders):
    requests = prompts(10, seed=5)
    requests[3] = requests[3] * 6  # longer than a step's token budget: prefilled in chunks
    requests[7] = requests[7] * 5
    names = [list(CHOICES)[index % len(CHOICES)] for index in range(len(requests))]
    lengths = [4 + 2 * index for index in range(len(requests))]  # each ends at its own step
    references = greedy_references(component_folders, {name: CHOICES[name][1] for name in CHOICES}, requests, 24)
    moves_before = engine.apply_model(lambda model: request_weights(model.vllm_config_id).moves)[0]
    outputs = engine.generate(
        [{"prompt_token_ids": prompt} for prompt in requests],
        [
            SamplingParams(max_tokens=length, temperature=0.0, extra_args=CHOICES[name][0])
            for name, length in zip(names, lengths)
        ],
        use_tqdm=False,
    )
    for index, (name, output) in enumerate(zip(names, outputs)):
        got = list(output.outputs[0].token_ids)
        assert got == references[name][index][: lengths[index]], (index, name)
    assert max(len(prompt) for prompt in requests) > TOKENS_PER_STEP
    moves = engine.apply_model(lambda model: request_weights(model.vllm_config_id).moves)[0] - moves_before
    assert moves > 0  # vLLM moved rows while requests of other choices ran on
    # The four chosen compositions differ on the same prompt: each request's own weights were used, not the folder's
    # (which are a+b's).
    assert len({tuple(references[name][0]) for name in CHOICES if name != "folder"}) == 4


def test_prompt_logprobs_use_the_folder_weights_beside_requests_that_choose(engine, component_folders):
    """A request with prompt log-probs, batched with requests that chose other experts, gets the folder's."""
    requests = prompts(3, seed=6)
    params = [
        SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0),
        SamplingParams(max_tokens=4, temperature=0.0, extra_args={"experts": "lora_b", "weights": "2"}),
        SamplingParams(max_tokens=4, temperature=0.0, extra_args={"experts": ""}),
    ]
    outputs = engine.generate([{"prompt_token_ids": prompt} for prompt in requests], params, use_tqdm=False)
    folder = [str(component_folders[name]) for name in ("lora_a", "lora_b")]
    with ComposedLM.from_pretrained(str(component_folders["base"]), folder, weights=[1.0, 0.5]) as composed:
        ids = torch.tensor([requests[0]])
        with torch.no_grad():
            expected = composed.logprobs(ids, torch.ones_like(ids))[0]  # (T, V)
    want = expected[torch.arange(len(requests[0]) - 1), torch.tensor(requests[0][1:])]
    got = torch.tensor([step[token].logprob for step, token in zip(outputs[0].prompt_logprobs[1:], requests[0][1:])])
    worst = (got - want).abs().max().item()
    print(f"prompt log-probs beside other choices, max abs diff vLLM vs ComposedLM: {worst:.3g}")
    assert worst < 1e-4


@pytest.mark.parametrize(
    ("extra_args", "message"),
    [
        ({"experts": "lora_c"}, "unknown expert 'lora_c'"),
        ({"experts": "lora_a,lora_b", "weights": "1.0"}, "holds 1 weights for the 2 experts"),
        ({"experts": "lora_a", "weights": "nan"}, "each weight must be a finite number"),
        ({"experts": "lora_a", "weights": "inf"}, "each weight must be a finite number"),
        ({"experts": "lora_a", "weights": "heavy"}, "`weights` 'heavy' is not a number"),
        ({"weights": "1.0"}, "without `experts`"),
        ({"experts": "lora_a,lora_a"}, "more than once"),
        ({"expert": "lora_a"}, "`vllm_xargs` key 'expert' is a near miss of `experts`"),
        ({"experts": "lora_a", "weights": "1_0"}, "`weights` '1_0' is not a number"),
        ({"experts": "lora_a", "weights": True}, "`weights` True is a boolean"),  # a bool kept: no request model
        ({"experts": "lora_a", "weights": 101}, r"`weights` 101 is beyond the bound \|w\| <= 100"),
    ],
)
def test_a_bad_choice_is_refused_before_it_runs(engine, extra_args, message):
    with pytest.raises(VLLMValidationError, match=message):
        engine.generate(
            [{"prompt_token_ids": prompts(1)[0]}], SamplingParams(max_tokens=2, extra_args=extra_args), use_tqdm=False
        )


def test_prompt_logprobs_with_own_experts_are_refused(engine):
    with pytest.raises(VLLMValidationError, match="prompt log-probs are composed with the server's own weights"):
        engine.generate(
            [{"prompt_token_ids": prompts(1)[0]}],
            SamplingParams(max_tokens=2, prompt_logprobs=0, extra_args={"experts": "lora_a"}),
            use_tqdm=False,
        )
    # The engine goes on.
    output = engine.generate(
        [{"prompt_token_ids": prompts(1)[0]}],
        SamplingParams(max_tokens=2, extra_args={"experts": "lora_a"}),
        use_tqdm=False,
    )
    assert len(output[0].outputs[0].token_ids) == 2
