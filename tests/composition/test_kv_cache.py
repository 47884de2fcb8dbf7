"""`GrowingCache` (composition/kv_cache.py) holds what transformers' `DynamicCache` holds, without re-concatenating.

Updates, crops and batch selections are applied to both, and the keys and values compared exactly;
the buffer is written in place while it has room, and a composition decodes the same tokens with either.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from mergecompose.composition import ComposedLM
from mergecompose.composition.kv_cache import GrowingCache, GrowingLayer
from mergecompose.core.tiny import left_padded_batch, tiny_llama_config


def states(generator, batch, columns):
    shape = (batch, 2, columns, 4)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def assert_same(growing, dynamic):
    torch.testing.assert_close(growing.keys, dynamic.keys, rtol=0, atol=0)
    torch.testing.assert_close(growing.values, dynamic.values, rtol=0, atol=0)
    assert growing.get_seq_length() == dynamic.get_seq_length()


def test_updates_crops_and_selections_hold_what_dynamic_layer_holds():
    generator = torch.Generator().manual_seed(0)
    for length in [None, 7, 40]:
        growing, dynamic = GrowingLayer(length), DynamicLayer()
        steps = [("update", 5), ("update", 1), ("update", 1), ("crop", -2), ("update", 3), ("select", None)]
        steps += [("update", 1)] * 4 + [("crop", -1), ("update", 300), ("crop", 0), ("update", 1)]
        batch = 3
        for action, count in steps:
            if action == "update":
                keys, values = states(generator, batch, count)
                out = growing.update(keys, values)
                reference = dynamic.update(keys, values)
                torch.testing.assert_close(out[0], reference[0], rtol=0, atol=0)
                torch.testing.assert_close(out[1], reference[1], rtol=0, atol=0)
            elif action == "crop":
                growing.crop(count)
                dynamic.crop(count)
            else:
                indices = torch.tensor([2, 0])
                growing.batch_select_indices(indices)
                dynamic.batch_select_indices(indices)
                batch = 2
            assert_same(growing, dynamic)


def test_the_buffer_is_written_in_place_while_it_has_room():
    generator = torch.Generator().manual_seed(1)
    layer = GrowingLayer(length=10)
    layer.update(*states(generator, 2, 6))
    buffer = layer.keys.data_ptr()
    for _ in range(4):
        layer.update(*states(generator, 2, 1))
        assert layer.keys.data_ptr() == buffer  # no copy: the same storage, one more column in view
    assert layer.get_seq_length() == 10
    layer.update(*states(generator, 2, 1))  # past the expected length: a new buffer, twice the columns
    assert layer.keys.data_ptr() != buffer
    assert layer._key_buffer is not None and layer._key_buffer.shape[-2] == 256  # _MIN_ROOM


def test_only_plain_full_attention_layers_are_replaced():
    config = tiny_llama_config()
    config.layer_types = ["sliding_attention", "full_attention"]
    config.sliding_window = 4
    cache = GrowingCache(config, length=12)
    reference = DynamicCache(config=config)
    assert [type(layer) for layer in reference.layers] == [DynamicSlidingWindowLayer, DynamicLayer]
    assert [type(layer) for layer in cache.layers] == [DynamicSlidingWindowLayer, GrowingLayer]


def test_a_composition_decodes_the_same_tokens_with_either_cache(base_model, expert_models):
    composed = ComposedLM(base_model, expert_models, weights=[0.6, 0.4])
    ids, mask = left_padded_batch([6, 3, 5])
    options = dict(max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    growing = composed.generate(ids, mask, **options)
    backend = composed.backend
    new_cache = backend.new_cache
    try:
        backend.new_cache = lambda length=None: [DynamicCache(config=m.config) for m in backend.models]
        dynamic = composed.generate(ids, mask, **options)
    finally:
        backend.new_cache = new_cache
    assert torch.equal(growing, dynamic)
    assert all(isinstance(cache, GrowingCache) for cache in new_cache(20))
