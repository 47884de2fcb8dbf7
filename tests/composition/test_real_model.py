"""ComposedLM on the real SmolLM2-135M-Instruct with two real LoRA experts (math, code): greedy decoding of a
left-padded batch of chat prompts equals a naive loop over three separately merged models, token for token."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergecompose.composition import ComposedLM
from mergecompose.studies.math_code import generation_inputs

# One torch thread: much faster on a loaded machine, and the adapters are trained under it (see `adapters`).
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Rows of unequal length whose greedy answers end (EOS) after about 6 and 14 tokens: one row pads while the
# other decodes, and decoding stops before NEW_TOKENS once both are done.
PROMPTS = ["What is 7 + 5?", "Give a Python expression for the square of x."]
WEIGHTS = [0.6, 0.9]  # math, code
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def adapters(one_torch_thread, request):
    """`smollm2_adapters`, requested here so that, if this module is the first to need them, they train under
    one thread (a session fixture asked for by a test is set up before any module fixture)."""
    return request.getfixturevalue("smollm2_adapters")


@pytest.fixture(scope="module")
def real(smollm2_dir, adapters):
    """The base, the tokenizer and the batch, and the naive loop's tokens and log-probs on them."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    experts = [
        PeftModel.from_pretrained(copy.deepcopy(base), str(adapters[name])).merge_and_unload().eval()
        for name in ("math", "code")
    ]
    inputs = generation_inputs(tokenizer, PROMPTS)
    eos = pad = base.generation_config.eos_token_id  # <|im_end|>: SmolLM2's pad is its EOS
    sequences, composed, components = naive_greedy([base, *experts], WEIGHTS, inputs, NEW_TOKENS, eos, pad)
    return {
        "base": base,
        "tokenizer": tokenizer,
        "inputs": inputs,
        "sequences": sequences,
        "logprobs": composed,
        "components": components,
    }


@torch.no_grad()
def naive_greedy(models, weights, inputs, max_new_tokens, eos, pad):
    """Every model on the whole prefix at every step (no cache), log p̂ = log p_b + Σ w_i (log p_i − log p_b)
    renormalised, argmax; a row that emitted EOS continues with `pad`.

    Returns the sequences `(B, T + n)`, the composed log-probs of every step `(B, n, V)` and the components'
    `(k + 1, B, n, V)`, base first."""
    ids, mask = inputs["input_ids"].clone(), inputs["attention_mask"].clone()  # (B, T) each
    finished = torch.zeros(ids.shape[0], dtype=torch.bool)
    composed_steps, component_steps = [], []
    for _ in range(max_new_tokens):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding skipped
        logits = [
            model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, logits_to_keep=1).logits
            for model in models
        ]  # (B, 1, V) each: the whole prefix runs, only the last position goes through the output layer
        logprobs = [torch.log_softmax(logit[:, -1], -1) for logit in logits]  # (B, V) each
        base = logprobs[0]
        scores = torch.log_softmax(base + sum(w * (lp - base) for w, lp in zip(weights, logprobs[1:])), -1)  # (B, V)
        next_tokens = torch.where(finished, torch.tensor(pad), scores.argmax(-1))  # (B,)
        composed_steps.append(scores)
        component_steps.append(torch.stack(logprobs))  # (k + 1, B, V)
        ids = torch.cat([ids, next_tokens[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        finished |= next_tokens == eos
        if finished.all():
            break
    return ids, torch.stack(composed_steps, dim=1), torch.stack(component_steps, dim=2)


def check_against_naive(lm: ComposedLM, real) -> None:
    inputs, expected = real["inputs"], real["sequences"]
    sequences = lm.generate(**inputs, max_new_tokens=NEW_TOKENS)
    assert torch.equal(sequences, expected), real["tokenizer"].batch_decode(
        sequences[:, inputs["input_ids"].shape[1] :]
    )
    # Teacher-forced on the decoded rows, the composed log-probs of the positions that predicted each new token.
    prompt_length, steps = inputs["input_ids"].shape[1], expected.shape[1] - inputs["input_ids"].shape[1]
    mask = torch.cat([inputs["attention_mask"], torch.ones(2, steps, dtype=torch.long)], dim=1)
    logprobs = lm.logprobs(sequences, mask)[:, prompt_length - 1 : -1]  # (B, n, V)
    torch.testing.assert_close(logprobs, real["logprobs"], atol=1e-3, rtol=0)


def test_naive_loop_is_a_real_composition(real):
    components, tokens = real["components"], real["sequences"][:, real["inputs"]["input_ids"].shape[1] :]
    # The adapters move the distribution: each expert differs from the base by far more than the tolerance.
    for expert in (1, 2):
        assert (components[expert] - components[0]).abs().max() > 0.1
    # The composition changes greedy choices of the base, and the answers are text, not padding.
    assert (components[0].argmax(-1) != real["logprobs"].argmax(-1)).any()
    assert (tokens[:, 0] != real["base"].generation_config.eos_token_id).all()


def test_from_adapters_decodes_as_the_naive_loop(real, adapters):
    base = copy.deepcopy(real["base"])  # from_adapters changes the base it is given, in place
    lm = ComposedLM.from_adapters(
        base, {name: str(adapters[name]) for name in ("math", "code")}, WEIGHTS, tokenizer=real["tokenizer"]
    )
    with lm:
        check_against_naive(lm, real)


def test_from_pretrained_with_the_adapter_folders_decodes_as_the_naive_loop(real, smollm2_dir, adapters):
    lm = ComposedLM.from_pretrained(
        smollm2_dir,
        [adapters["math"], adapters["code"]],
        WEIGHTS,
        names=["math", "code"],
        lora_implementation="peft",  # from_adapters above runs the default, "stacked"
        dtype=torch.float32,
    )
    with lm:
        assert lm.expert_names == ["math", "code"] and lm.tokenizer is not None
        check_against_naive(lm, real)
