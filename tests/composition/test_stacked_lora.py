"""The stacked LoRA products at a decoding step (kernels/stacked_lora.py): siblings that read one input share one
product.

q, k and v read the same hidden state; each linear gets its own view of it (a reshape), so the product x A
of all their columns is reused by what the input is (memory, layout, version), not by the view's identity."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from mergecompose.composition import ComposedLM
from mergecompose.core.tiny import random_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def composition(tiny_config, lora_dirs):
    """The base's weights packed where oneDNN can (`pack_weights=True`, whatever timing would choose)."""
    adapters = {k: str(v) for k, v in lora_dirs.items()}
    lm = ComposedLM.from_adapters(random_llama(tiny_config, seed=0), adapters, pack_weights=True)
    yield lm
    lm.close()


@pytest.fixture
def dense_composition(tiny_config, lora_dirs):
    """The base's weights left dense (as where oneDNN cannot pack them, or packing timed slower): the A products are
    computed by `mm`."""
    adapters = {k: str(v) for k, v in lora_dirs.items()}
    lm = ComposedLM.from_adapters(random_llama(tiny_config, seed=0), adapters, pack_weights=False)
    yield lm
    lm.close()


def _products_of_groups(composition, run):
    """How many times each sibling group's side-by-side A was multiplied while `run()` ran."""
    groups = composition.backend.stacked._groups
    counts = [0] * len(groups)
    real_mm = torch.mm

    def counting_mm(left, right, *args, **kwargs):
        for index, group in enumerate(groups):
            if right is group.a_side:
                counts[index] += 1
        return real_mm(left, right, *args, **kwargs)

    with mock.patch.object(torch, "mm", counting_mm):
        run()
    return counts


def _step_products(composition):
    step = torch.tensor([[5], [7]])  # (B, 1): a decoding step's rows
    with torch.no_grad():
        return _products_of_groups(
            composition, lambda: composition.backend.forward(step, torch.ones_like(step), torch.zeros_like(step))
        )


def test_siblings_share_one_product_a_pass(dense_composition):
    groups = dense_composition.backend.stacked._groups
    assert groups  # both adapters put LoRA on q_proj and v_proj: a group per layer
    assert _step_products(dense_composition) == [1] * len(groups)  # one product for q and v, not one each


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_packed_weights_compute_the_a_products_with_the_base(composition, dense_composition):
    """Where the base is packed, x A comes out of the base's product (few_row_linear.py, extra rows): no `mm` for it,
    and the same logits as the dense composition's."""
    assert _step_products(composition) == [0] * len(composition.backend.stacked._groups)
    ids, mask = torch.tensor([[4, 5, 6, 7], [0, 8, 9, 10]]), torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    torch.testing.assert_close(
        composition.logprobs(ids, mask), dense_composition.logprobs(ids, mask), rtol=0, atol=1e-5
    )


def test_a_changed_input_is_not_reused(composition):
    """A group's product is kept only for the input it was computed from: another tensor, or the same one
    changed in place, gets a new product."""
    group = composition.backend.stacked._groups[0]
    x = torch.randn(6, group.a_side.shape[0])
    group.x, group.version = x.reshape(6, -1), x._version
    assert group.reads(x.reshape(6, -1)) and group.reads(x.view(6, -1))
    assert not group.reads(x.clone())  # same values, other memory
    assert not group.reads(x[1:])  # other rows
    x.add_(1.0)
    assert not group.reads(x.reshape(6, -1))  # changed in place: its version moved
    group.clear()


def test_decoding_under_inference_mode_equals_no_grad(composition):
    """Tensors made under torch.inference_mode have no version counter: the stacked path still decodes, the same
    tokens as under no_grad, and computes each sibling's product itself rather than reuse one it cannot check."""
    ids = torch.tensor([[5, 9, 3, 4], [7, 2, 8, 6]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = composition.generate(ids, mask, max_new_tokens=6)
    with torch.inference_mode():
        got = composition.generate(ids, mask, max_new_tokens=6)
        step = torch.tensor([[5], [7]])
        counts = _products_of_groups(
            composition, lambda: composition.backend.forward(step, torch.ones_like(step), torch.zeros_like(step))
        )
    assert torch.equal(got, expected)
    # One product per sibling, none reused; where the base is packed, the first sibling's comes with the base's.
    packed = torch.backends.mkldnn.is_available()
    members = [len(group.members) - packed for group in composition.backend.stacked._groups]
    assert counts == members
    group = composition.backend.stacked._groups[0]
    with torch.inference_mode():
        x = torch.randn(6, group.a_side.shape[0])
    group.x, group.version = x, None
    assert not group.reads(x)  # the very same tensor: its version cannot be checked
    group.clear()
