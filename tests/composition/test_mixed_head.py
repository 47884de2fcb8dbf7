"""Mixing the components' last hidden states before the shared output layer (kernels/mixed_head.py) is the rule.

With LoRA experts that leave the output layer alone, log_softmax(W Σ_c e_c h_c) equals the rule on the
components' logits, e_c the rule's exponents (base 1 − Σ w_i); checked here against `compose_logprobs` on the
same pass, and greedy decoding, plain and speculative, against decoding with every component's logits. Where
the identity does not hold (remedies, LoRA on the output layer, logits changed after it) nothing is mixed."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from mergecompose.composition import ComposedLM, compose_logprobs
from mergecompose.composition.kernels.mixed_head import (
    MixedHead,
    can_mix,
    compose_mixed,
    exponents,
    head_is_last,
    row_exponents,
)
from mergecompose.composition.remedies import ActivityGate
from mergecompose.core.tiny import EOS, PAD, left_padded_batch, random_llama, random_lora_adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_exponents_are_the_rules():
    assert exponents(None, 2) == [-1.0, 1.0, 1.0]
    assert exponents([0.7, 1.3], 2) == pytest.approx([-1.0, 0.7, 1.3])
    rows = [[0.7, 1.3], [0.0, 0.0], [-0.5, 2.0]]
    for got, row in zip(row_exponents(torch.tensor(rows)).tolist(), rows):
        assert got == pytest.approx(exponents(row, 2))
    assert exponents([0.5], 1) == [0.5, 0.5]


@pytest.fixture
def composition(tiny_config, lora_dirs):
    lm = ComposedLM.from_adapters(
        random_llama(tiny_config, seed=0), {k: str(v) for k, v in lora_dirs.items()}, weights=[0.7, 1.3]
    )
    lm.mix_before_head = True  # mixed wherever it can be, whatever timing would choose
    yield lm
    lm.close()


def test_a_mixed_pass_gives_the_rule_on_the_components_logits(composition):
    ids, mask = left_padded_batch([6, 4], seed=3)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    backend = composition.backend
    assert can_mix(backend)
    with torch.no_grad():
        components = backend.forward(ids, mask, positions)  # (k+1, B, T, V)
        mixed = MixedHead(backend, exponents(composition.weights, 2))
        try:
            got = compose_mixed(mixed.forward(ids, mask, positions))  # (B, T, V)
        finally:
            mixed.close()
    head = backend.base_model.get_output_embeddings()
    assert not head._forward_pre_hooks  # closed: the hook is gone
    expected = compose_logprobs(components[0], list(components[1:]), composition.weights)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("draft", [None, "merged"])
def test_greedy_decoding_mixed_equals_every_components_logits(composition, draft):
    ids, mask = left_padded_batch([6, 4], seed=5)
    kwargs = dict(max_new_tokens=12, eos_token_id=EOS, pad_token_id=PAD, draft=draft)
    assert composition._mixes_before_head(2)
    mixed = composition.generate(ids, mask, **kwargs)
    composition.mix_before_head = False
    assert not composition._mixes_before_head(2)
    plain = composition.generate(ids, mask, **kwargs)
    assert torch.equal(mixed, plain)
    assert not composition.base_model.get_output_embeddings()._forward_pre_hooks


def test_nothing_is_mixed_where_the_identity_does_not_hold(tiny_config, lora_dirs, tmp_path):
    adapters = {k: str(v) for k, v in lora_dirs.items()}
    with ComposedLM.from_adapters(random_llama(tiny_config, seed=0), adapters, remedies=[ActivityGate()]) as gated:
        assert not gated._mixes_before_head(1)  # remedies need each component's distribution
    base = random_llama(tiny_config, seed=0)
    on_head = random_lora_adapter(base, tmp_path / "head", seed=3, target_modules=["q_proj", "lm_head"])
    with ComposedLM.from_adapters(base, {"head": str(on_head), "ab": adapters["ab"]}) as lm:
        assert not can_mix(lm.backend)  # each component has its own output layer
    with ComposedLM.from_adapters(random_llama(tiny_config, seed=0), adapters, lora_implementation="peft") as lm:
        assert not can_mix(lm.backend)
    full = [random_llama(tiny_config, seed=seed) for seed in (0, 1)]
    assert not can_mix(ComposedLM(full[0], full[1:]).backend)  # full experts: one output layer each


def test_logits_changed_after_the_output_layer_are_seen():
    config = Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=30.0,
    )
    torch.manual_seed(0)
    capped = Gemma2ForCausalLM(config).eval()
    assert not head_is_last(capped)  # tanh soft-capping after the output layer
    capped.config.final_logit_softcapping = None
    assert head_is_last(capped)


def test_a_plain_model_has_its_head_last(tiny_config):
    assert head_is_last(random_llama(tiny_config, seed=4))
