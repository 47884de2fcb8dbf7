"""The shared base's linears with oneDNN-packed weights (kernels/packed_weights.py): same results, same memory,
given back.

While a stacked LoRA composition is open, its base's decoder linears hold their weights in oneDNN's packed layout
and their parameters hold empty tensors. These tests pin what a user of the base can rely on meanwhile and after."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from mergecompose.composition import ComposedLM
from mergecompose.composition.kernels import packed_weights
from mergecompose.composition.kernels.packed_weights import PACKED, Packed, PackedSibling
from mergecompose.core.tiny import EOS, PAD, left_padded_batch, random_llama
from mergecompose.merging import TaskVector

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN"),
]


def _adapters(lora_dirs):
    return {name: str(folder) for name, folder in lora_dirs.items()}


def _packed_modules(model):
    return [name for name, module in model.named_modules() if PACKED in module.__dict__]


def test_packed_composition_decodes_as_the_dense_one(tiny_config, lora_dirs):
    ids, mask = left_padded_batch([6, 4], seed=7)
    packed = ComposedLM.from_adapters(random_llama(tiny_config, seed=0), _adapters(lora_dirs), pack_weights=True)
    dense = ComposedLM.from_adapters(random_llama(tiny_config, seed=0), _adapters(lora_dirs), pack_weights=False)
    assert _packed_modules(packed.backend.model) and not _packed_modules(dense.backend.model)
    # 2 layers x 7 projections; the output layer stays dense (its shape is the vocabulary).
    assert len(_packed_modules(packed.backend.model)) == 14
    torch.testing.assert_close(packed.logprobs(ids, mask), dense.logprobs(ids, mask), rtol=0, atol=1e-5)
    kwargs = dict(max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(packed.generate(ids, mask, **kwargs), dense.generate(ids, mask, **kwargs))


def test_the_base_gets_its_weights_back_bit_for_bit(tiny_config, lora_dirs):
    base = random_llama(tiny_config, seed=0)
    before = {name: (parameter, parameter.detach().clone()) for name, parameter in base.named_parameters()}
    composed = ComposedLM.from_adapters(base, _adapters(lora_dirs), pack_weights=True)
    q_proj = base.model.layers[0].self_attn.q_proj
    assert q_proj.weight.numel() == 0  # the dense bytes are freed while packed
    # state_dict() meanwhile gives the dense weights, equal to the originals.
    state = base.state_dict()
    for name, (_, value) in before.items():
        assert torch.equal(state[name], value), name
    composed.close()
    assert not _packed_modules(base)
    for name, parameter in base.named_parameters():
        original, value = before[name]
        assert parameter is original and torch.equal(parameter, value), name


def test_a_deep_copy_made_while_packed_computes_on_its_own(tiny_config, lora_dirs):
    base = random_llama(tiny_config, seed=0)
    reference = random_llama(tiny_config, seed=0)
    composed = ComposedLM.from_adapters(base, _adapters(lora_dirs), pack_weights=True)
    copied = copy.deepcopy(base)
    composed.close()
    ids = torch.tensor([[4, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(copied(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
        held = copied.model.layers[0].mlp.down_proj.__dict__[PACKED]
        held = getattr(held, "group", held)  # packed alone, or with the LoRA factors A (a group of one)
        held.tensor = torch.ops.mkldnn._reorder_linear_weight(torch.zeros_like(held.dense()), 1)
        assert (copied(ids).logits - reference(ids).logits).abs().max() > 1e-3  # the copy's own weights serve it
        torch.testing.assert_close(base(ids).logits, reference(ids).logits, rtol=0, atol=0)  # the original is back


def test_a_forward_that_needs_gradients_gets_them(tiny_config, lora_dirs):
    """oneDNN's packed product has no autograd formula: a forward with gradients uses the dense weight."""
    base = random_llama(tiny_config, seed=0)
    reference = random_llama(tiny_config, seed=0)
    composed = ComposedLM.from_adapters(base, _adapters(lora_dirs), pack_weights=True)
    q_proj, expected = base.model.layers[0].self_attn.q_proj, reference.model.layers[0].self_attn.q_proj
    x = torch.randn(3, tiny_config.hidden_size, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    q_proj(x).square().sum().backward()
    expected(x_ref).square().sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-5)
    composed.close()


def test_a_weight_held_elsewhere_keeps_its_bytes(tiny_config, lora_dirs):
    """Packing releases a weight's pages only where nothing else holds them: an alias still reads its values."""
    base = random_llama(tiny_config, seed=0)
    alias = base.model.layers[0].self_attn.q_proj.weight.data  # another tensor on the same storage
    expected = alias.clone()
    composed = ComposedLM.from_adapters(base, _adapters(lora_dirs), pack_weights=True)
    assert torch.equal(alias, expected)
    composed.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pages are released on Linux only")
def test_pages_are_released_only_where_nothing_else_holds_them():
    held = torch.ones(1 << 20)  # 4 MiB: many whole pages
    alias = held.view(-1)
    packed_weights._release_pages(held)
    assert bool((alias == 1).all())  # shared: left alone
    del alias
    alone = torch.ones(1 << 20)
    packed_weights._release_pages(alone)
    # Anonymous memory comes back as zeros: the pages were given back (nothing reads them in real use).
    assert float(alone.sum()) < alone.numel()


def test_the_merging_api_reads_and_copies_a_base_held_packed(tiny_config, lora_dirs):
    """A user who merges from the base a composition holds gets what the dense base gives."""
    base = random_llama(tiny_config, seed=0)
    reference = random_llama(tiny_config, seed=0)
    composed = ComposedLM.from_adapters(base, _adapters(lora_dirs), pack_weights=True)
    assert _packed_modules(base)
    tau = TaskVector.from_lora(base, lora_dirs["cd"])
    expected = TaskVector.from_lora(reference, lora_dirs["cd"])
    assert tau.tensors.keys() == expected.tensors.keys()
    for name, tensor in expected.tensors.items():
        assert torch.equal(tau.tensors[name], tensor), name
    merged, merged_reference = tau.apply_to(base), expected.apply_to(reference)
    assert not _packed_modules(merged)  # loading its new weights made the copy dense
    ids = torch.tensor([[4, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, merged_reference(ids).logits, rtol=0, atol=1e-5)
    assert _packed_modules(base)  # the original is still the composition's
    composed.close()


def test_a_state_dict_loaded_while_packed_is_kept_at_close(tiny_config, lora_dirs):
    base = random_llama(tiny_config, seed=0)
    other = random_llama(tiny_config, seed=1)
    composed = ComposedLM.from_adapters(base, _adapters(lora_dirs), pack_weights=True)
    base.load_state_dict(other.state_dict())
    assert not _packed_modules(base)
    composed.close()
    for name, tensor in other.state_dict().items():
        assert torch.equal(base.state_dict()[name], tensor), name


def test_siblings_that_read_one_input_are_one_packed_product(tiny_config, lora_dirs, monkeypatch):
    """q/k/v and gate/up are packed as one matrix each: a forward runs 4 oneDNN products a layer, not 7 (and not 9
    for the A products of q/v and down, packed with the weights)."""
    base = random_llama(tiny_config, seed=0)
    composed = ComposedLM.from_adapters(base, _adapters(lora_dirs), pack_weights=True)
    layer = base.model.layers[0]
    attention, mlp = layer.self_attn, layer.mlp
    held = {name: getattr(attention, name).__dict__[PACKED] for name in ["q_proj", "k_proj", "v_proj", "o_proj"]}
    held.update({name: getattr(mlp, name).__dict__[PACKED] for name in ["gate_proj", "up_proj", "down_proj"]})
    assert all(isinstance(held[name], PackedSibling) for name in ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"])
    assert held["q_proj"].group is held["k_proj"].group is held["v_proj"].group
    assert held["gate_proj"].group is held["up_proj"].group is not held["q_proj"].group
    # The LoRA factors A of modules that both experts adapt are packed with the weights (kernels/stacked_lora.py): q/v's
    # side by side after q/k/v's weights, read by q; down's with its weight, a group of one. Only one expert adapts
    # o, and neither gate nor up: no extra rows.
    assert held["q_proj"].extra is not None and held["k_proj"].extra is None and held["v_proj"].extra is None
    assert held["down_proj"].group.sizes == [tiny_config.hidden_size] and held["down_proj"].extra is not None
    assert isinstance(held["o_proj"], Packed) and held["gate_proj"].group.extra is None
    products = []
    linear = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *args: products.append(1) or linear(*args))
    composed.logprobs(torch.tensor([[4, 5, 6, 7]]), torch.ones(1, 4, dtype=torch.long))
    # 2 layers x (q/k/v, o, gate/up, down) and the output layer's dense product.
    assert len(products) == 2 * 4 + 1
    composed.close()


def test_a_sibling_computes_anew_what_it_cannot_take(tiny_config, lora_dirs):
    """A sibling takes its columns of the kept product only for the same input, unchanged, and only once."""
    base = random_llama(tiny_config, seed=0)
    reference = random_llama(tiny_config, seed=0)
    composed = ComposedLM.from_adapters(base, _adapters(lora_dirs), pack_weights=True)
    attention, expected = base.model.layers[1].self_attn, reference.model.layers[1].self_attn
    x, other = torch.randn(3, tiny_config.hidden_size), torch.randn(3, tiny_config.hidden_size)
    with torch.no_grad():

        def check(name, value):
            got, want = getattr(attention, name)(value), getattr(expected, name)(value)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

        check("q_proj", x)
        check("q_proj", x)  # its columns a second time
        check("k_proj", x)  # taken from the kept product
        x.mul_(2.0)  # changed in place, the same memory: the version counter moves
        check("v_proj", x)
        check("k_proj", other)  # another input
        check("q_proj", x)
    composed.close()


def test_siblings_deep_copied_together_share_their_copy(tiny_config, lora_dirs):
    base = random_llama(tiny_config, seed=0)
    composed = ComposedLM.from_adapters(base, _adapters(lora_dirs), pack_weights=True)
    copied = copy.deepcopy(base)
    original = base.model.layers[0].self_attn
    attention = copied.model.layers[0].self_attn
    group = attention.q_proj.__dict__[PACKED].group
    assert group is attention.k_proj.__dict__[PACKED].group is attention.v_proj.__dict__[PACKED].group
    assert group is not original.q_proj.__dict__[PACKED].group
    composed.close()
    assert torch.equal(attention.q_proj.__dict__[PACKED].dense(), original.q_proj.weight)
