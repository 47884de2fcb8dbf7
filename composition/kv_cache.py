"""A KV cache that grows into spare room instead of being re-concatenated at every step.

transformers' `DynamicLayer.update` is `keys = cat([keys, new])`: each decoding step copies the
whole cache of every layer. For a composition the cache holds (k+1)·B rows, so the copy is k+1
times the base's, and at batch 64 over a few hundred tokens it is gigabytes a step. `GrowingLayer`
keeps a buffer with room to spare along the sequence and writes each step's columns into it;
`keys` and `values` are views of the buffer's first columns, so everything that reads them
(attention, `get_seq_length`, `crop`) sees what `DynamicLayer` would. When the room runs out the
buffer doubles (one copy, amortised over as many steps as it held). A cache told how many columns
it will hold (`length`: the prompt and the tokens to make) sizes its first buffer to that and never
copies. When something replaced `keys` with a tensor of its own (`batch_select_indices`,
`reorder_cache`, offloading), the next update starts a new buffer from it.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

# The least room a new buffer gets, in sequence columns.
_MIN_ROOM = 256


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose update writes into a buffer of spare columns (module docstring)."""

    def __init__(self, length: int | None = None, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.length = length  # the columns it is expected to hold, if known
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self.get_seq_length()
        if held == 0:
            self._key_buffer = self._value_buffer = None
        new_length = held + key_states.shape[-2]
        if not self._fits(key_states, new_length):
            room = _room(new_length, self.length)
            self._key_buffer = _buffer(self.keys if held else None, key_states, room)
            self._value_buffer = _buffer(self.values if held else None, value_states, room)
        assert self._key_buffer is not None and self._value_buffer is not None
        self._key_buffer[..., held:new_length, :] = key_states
        self._value_buffer[..., held:new_length, :] = value_states
        self.keys = self._key_buffer[..., :new_length, :]
        self.values = self._value_buffer[..., :new_length, :]
        return self.keys, self.values

    def _fits(self, key_states: torch.Tensor, new_length: int) -> bool:
        """True if `keys` is still the buffer's own view and the buffer has room for `new_length` columns."""
        buffer, keys = self._key_buffer, self.keys
        if buffer is None or keys is None or keys.numel() == 0:
            return False
        return (
            new_length <= buffer.shape[-2]
            and keys.data_ptr() == buffer.data_ptr()
            and keys.stride() == buffer.stride()
            and keys.shape[:-2] == buffer.shape[:-2] == key_states.shape[:-2]
            and keys.dtype == key_states.dtype
            and self.values is not None
            and self._value_buffer is not None
            and self.values.data_ptr() == self._value_buffer.data_ptr()
        )

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        super().reset()


def _room(new_length: int, expected: int | None) -> int:
    """Columns for a new buffer: the expected length if it holds `new_length`, else max(2 × new_length, _MIN_ROOM)."""
    if expected is not None and expected >= new_length:
        return expected
    return max(2 * new_length, _MIN_ROOM)


def _buffer(past: torch.Tensor | None, new: torch.Tensor, room: int) -> torch.Tensor:
    """A buffer shaped like `new` with `room` columns, `past` copied into its first ones."""
    buffer = new.new_empty((*new.shape[:-2], room, new.shape[-1]))
    if past is not None:
        buffer[..., : past.shape[-2], :] = past
    return buffer


class GrowingCache(DynamicCache):
    """`DynamicCache(config=…)` with its plain full-attention layers made `GrowingLayer`s.

    Sliding-window and other special layers stay what transformers makes them. `length`: the columns
    it will hold at most (prompt and new tokens), if known: the buffers are then made that size once."""

    def __init__(self, config: PretrainedConfig, length: int | None = None) -> None:
        super().__init__(config=config)
        self.layers = [GrowingLayer(length) if type(layer) is DynamicLayer else layer for layer in self.layers]
        if self.layer_class_to_replicate is DynamicLayer:
            self.layer_class_to_replicate = GrowingLayer
