"""The composed vLLM model against the reference, `ComposedLM`: greedy tokens, log-probs, continuous batching.

Two compositions of one base (tests/integrations/vllm/engine/conftest.py): two full experts, and two
LoRA experts at weights 1 and 0.5 sharing the base's weights. One engine per composition, float32 on
the CPU.
"""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm_engines import greedy_references, prompts, start_engine, stop_engine

from mergecompose.composition import ComposedLM

EXPERTS = {"full": (["full_a", "full_b"], None), "lora": (["lora_a", "lora_b"], [1.0, 0.5])}
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module", params=sorted(EXPERTS))
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def engine(kind, composed_folders):
    engine = start_engine(composed_folders[kind])
    yield engine
    stop_engine(engine)


@pytest.fixture(scope="module")
def reference(kind, component_folders):
    names, weights = EXPERTS[kind]
    experts = [str(component_folders[name]) for name in names]
    with ComposedLM.from_pretrained(str(component_folders["base"]), experts, weights=weights) as composed:
        yield composed


def reference_greedy(reference: ComposedLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """One prompt alone, greedy, up to EOS (included) or `max_new_tokens`."""
    ids = torch.tensor([prompt])
    out = reference.generate(
        ids, torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=2, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_tokens_equal_the_reference(engine, reference, component_folders):
    requests = prompts(8)
    outputs = engine.generate(
        [{"prompt_token_ids": prompt} for prompt in requests],
        SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0),
        use_tqdm=False,
    )
    got = [list(output.outputs[0].token_ids) for output in outputs]
    assert got == [reference_greedy(reference, prompt, MAX_NEW_TOKENS) for prompt in requests]
    assert sum(map(len, got)) > 8 * MAX_NEW_TOKENS // 2  # most run the full length: EOS is not all there is
    base = reference.base_model
    alone = [
        base.generate(
            torch.tensor([p]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=2, pad_token_id=0
        )[0, len(p) :].tolist()
        for p in requests
    ]
    assert got != alone  # the composition is not the base


def test_logprobs_equal_the_reference(engine, reference):
    requests = prompts(8, seed=1)
    outputs = engine.generate(
        [{"prompt_token_ids": prompt} for prompt in requests],
        SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, logprobs=0, prompt_logprobs=0),
        use_tqdm=False,
    )
    worst = 0.0
    for prompt, output in zip(requests, outputs):
        generated = list(output.outputs[0].token_ids)
        sequence = prompt + generated
        ids = torch.tensor([sequence])
        with torch.no_grad():
            expected = reference.logprobs(ids, torch.ones_like(ids))[0]  # (T, V)
        want = expected[torch.arange(len(sequence) - 1), torch.tensor(sequence[1:])]  # (T-1,): log p̂(x_t+1 | x_≤t)
        prompt_part = [step[token].logprob for step, token in zip(output.prompt_logprobs[1:], prompt[1:])]
        sampled_part = [step[token].logprob for step, token in zip(output.outputs[0].logprobs, generated)]
        got = torch.tensor(prompt_part + sampled_part)
        assert output.prompt_logprobs[0] is None and len(got) == len(want)
        worst = max(worst, (got - want).abs().max().item())
    print(f"log-prob max abs diff vLLM vs ComposedLM: {worst:.3g}")
    assert worst < 1e-4


def test_continuous_batching_gives_each_request_its_own_output(engine):
    requests = prompts(16, seed=2)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    together = engine.generate([{"prompt_token_ids": prompt} for prompt in requests], params, use_tqdm=False)
    alone = [engine.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0] for prompt in requests]
    assert len({len(prompt) for prompt in requests}) > 8  # different lengths, scheduled together
    assert [list(o.outputs[0].token_ids) for o in together] == [list(o.outputs[0].token_ids) for o in alone]


def test_mixing_before_the_head_or_not_gives_the_reference(engine, kind, reference):
    """LoRA experts share the base's head: the composite may mix the final hidden states before one head pass, as
    timing at each row count chooses; fixed either way, it gives the reference's tokens and log-probs."""
    assert engine.apply_model(lambda model: model.can_mix) == [kind == "lora"]  # full experts: a head each
    requests = prompts(4, seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    for mix in (True, False, None):
        engine.apply_model(lambda model, mix=mix: model.set_mix_before_head(mix))
        outputs = engine.generate([{"prompt_token_ids": prompt} for prompt in requests], params, use_tqdm=False)
        for prompt, output in zip(requests, outputs):
            generated = list(output.outputs[0].token_ids)
            assert generated == reference_greedy(reference, prompt, 8)
            ids = torch.tensor([prompt + generated])
            with torch.no_grad():
                expected = reference.logprobs(ids, torch.ones_like(ids))[0, len(prompt) - 1 : -1]  # (n, V)
            got = torch.tensor([step[token].logprob for step, token in zip(output.outputs[0].logprobs, generated)])
            want = expected[torch.arange(len(generated)), torch.tensor(generated)]
            assert (got - want).abs().max().item() < 1e-4
    chosen = engine.apply_model(lambda model: {bucket: choice.chosen for bucket, choice in model.mixing.items()})[0]
    if kind == "lora":  # timed at the row counts it met (4 requests, then fewer as they end), each chosen
        assert chosen and set(chosen.values()) <= {"mixed", "per component"}
    else:
        assert chosen == {}


def test_requests_choose_their_experts_in_one_batch(engine, kind, component_folders):
    """Per-request experts (`vllm_xargs`), full or LoRA: a component that no request of the batch weighs gets no
    head pass, and each request's tokens are ComposedLM's for its own choice."""
    first, second = EXPERTS[kind][0]
    choices = {
        "base": ({"experts": []}, ([first], [0.0])),
        "first": ({"experts": first}, ([first], [1.0])),
        "both": ({"experts": f"{first},{second}", "weights": "0.5,1.5"}, ([first, second], [0.5, 1.5])),
    }
    requests = prompts(6, seed=4)
    names = [list(choices)[index % 3] for index in range(len(requests))]
    references = greedy_references(
        component_folders, {name: choice[1] for name, choice in choices.items()}, requests, 8
    )
    for batch in (range(len(requests)), [0, 1, 3, 4]):  # with every expert weighed, and without the second
        outputs = engine.generate(
            [{"prompt_token_ids": requests[index]} for index in batch],
            [SamplingParams(max_tokens=8, temperature=0.0, extra_args=choices[names[index]][0]) for index in batch],
            use_tqdm=False,
        )
        for index, output in zip(batch, outputs):
            assert list(output.outputs[0].token_ids) == references[names[index]][index], (index, names[index])
    assert len({tuple(references[name][0]) for name in choices}) == 3
