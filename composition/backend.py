"""The one interface between `ComposedLM` (its decoding loops, its drafts) and what runs the k+1 components.

Two backends implement it: `SeparateModels` (separate_models.py), one full model and one cache per
component, and `SharedAdapters` (shared_adapters.py), k LoRA adapters on one base, every component in
one pass over a replicated batch, with stacked LoRA products (kernels/stacked_lora.py) or peft's mixed batches.
A draft model is a one-component `SeparateModels`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

# One cache per model the backend runs (`GrowingCache`s, kv_cache.py).
Caches = list[DynamicCache]


class Backend(Protocol):
    """k+1 components, base first, behind one forward pass."""

    @property
    def device(self) -> torch.device:
        """Where the inputs go."""
        ...

    @property
    def base_model(self) -> PreTrainedModel:
        """The base model (with LoRA experts: the shared base)."""
        ...

    @property
    def models(self) -> Sequence[PreTrainedModel]:
        """The models that run: their attention and dtype decide the attention mask of a pass over several tokens."""
        ...

    @property
    def shares_one_base(self) -> bool:
        """True if every component is one pass of the same base, so that a draft can only add work at batch 1."""
        ...

    def new_cache(self, length: int | None = None) -> Caches:
        """Empty KV caches, one per model in `models`; `length`: the columns they will hold, if known."""
        ...

    def keep_rows(self, caches: Caches, rows: torch.Tensor, batch: int) -> None:
        """Keep, in `caches`, only the batch rows `rows` `(b,)` of the `batch` they hold, in that order."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Caches | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Logits `(k+1, B, T', V)` of every component, base first, for `(B, T)` inputs.

        `attention_mask` is `(B, C)`, or a 4D additive mask `(B, 1, T, C)`; T' is T, or the last
        `logits_to_keep` positions. With `cache`, the caches grow by T columns."""
        ...

    def merged_draft(self, lambdas: Sequence[float]) -> PreTrainedModel:
        """The task-arithmetic merge θ_b + Σ_i λ_i (θ_i − θ_b) of the components, as a new model."""
        ...

    def close(self) -> None:
        """Give the caller's models back as they were."""
        ...
