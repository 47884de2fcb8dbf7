"""The backend of LoRA experts: k adapters on one base, every component in one forward pass over a replicated batch.

Rows are component-major: `[base | expert_1 | … | expert_k]`, B rows each. Two implementations
give the same numbers (pinned in tests):

* "stacked" (default, faster): the LoRA products of all experts are added with one batched
  matmul per module (`StackedLoRA`, kernels/stacked_lora.py), on the plain base model.
* "peft": peft's mixed-adapter batch, `adapter_names=["__base__"]*B + [name_1]*B + ...`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import cast

import torch
from transformers import PreTrainedModel

from mergecompose.composition.architecture import cache_kwarg
from mergecompose.composition.backend import Caches
from mergecompose.composition.kernels.stacked_lora import StackedLoRA, StackedLoRAUnsupported
from mergecompose.composition.kv_cache import GrowingCache
from mergecompose.composition.speculative.drafts import merged_lora_draft
from mergecompose.core.adapters import TrainingFlags, load_adapters_on_base
from mergecompose.core.boundary import check_adapter

logger = logging.getLogger(__name__)


class SharedAdapters:
    """One base with LoRA adapters, run as `implementation` ("stacked", or "peft" where stacked cannot).

    The adapters are loaded onto `base_model` in place; `close()` gives it back as it was (no
    LoRA layers, no patched forwards, its train/eval modes and `requires_grad` flags).
    """

    def __init__(
        self,
        base_model: PreTrainedModel,
        adapters: Mapping[str, object],
        implementation: str = "stacked",
        pack_weights: bool | None = None,
    ) -> None:
        self.flags = TrainingFlags(base_model)  # before peft freezes the base and sets eval()
        for name, source in adapters.items():  # every adapter's files, before the first one loads
            if isinstance(source, (str, os.PathLike)):
                check_adapter(source, f"adapters[{name!r}]")
        self.adapters = dict(adapters)  # the sources, for a merged draft
        peft_model, adapter_names = load_adapters_on_base(base_model, adapters)
        self.components = ["__base__", *adapter_names]
        self.stacked = None
        if implementation == "stacked":
            try:
                self.stacked = StackedLoRA(peft_model, adapter_names, pack=pack_weights)
            except StackedLoRAUnsupported as reason:
                logger.info("using peft's mixed-adapter batches: %s", reason)
        self.implementation = "stacked" if self.stacked is not None else "peft"
        self.model = self.stacked.model if self.stacked is not None else peft_model
        # peft's `get_base_model` is typed nn.Module; it is the transformers model that peft wraps.
        base = self.model if self.stacked is not None else peft_model.get_base_model()
        self._base_model = cast(PreTrainedModel, base)
        self.cache_kwarg = cache_kwarg(self._base_model)
        self._names_for_batch: dict[int, list[str]] = {}

    @property
    def device(self) -> torch.device:
        return self._base_model.device

    @property
    def base_model(self) -> PreTrainedModel:
        return self._base_model

    @property
    def models(self) -> list[PreTrainedModel]:
        return [self._base_model]

    @property
    def shares_one_base(self) -> bool:
        return True

    def new_cache(self, length: int | None = None) -> Caches:
        return [GrowingCache(self._base_model.config, length)]

    def keep_rows(self, caches: Caches, rows: torch.Tensor, batch: int) -> None:
        """The cache holds (k+1)·B rows, component-major: keep `rows` of each component's B."""
        offsets = torch.arange(len(self.components), device=rows.device) * batch
        caches[0].batch_select_indices((offsets[:, None] + rows[None, :]).reshape(-1))

    def merged_draft(self, lambdas: Sequence[float]) -> PreTrainedModel:
        return merged_lora_draft(self._base_model, self.adapters, lambdas)

    def close(self) -> None:
        """Remove the adapters from the base model (no merge) and restore its flags."""
        if self.stacked is not None:
            self.stacked.close()  # peft's LoRA layers were unloaded when the factors were stacked
        else:
            self.model.unload()
        self.flags.restore()

    def _adapter_names(self, batch: int) -> list[str]:
        if batch not in self._names_for_batch:
            self._names_for_batch[batch] = [name for name in self.components for _ in range(batch)]
        return self._names_for_batch[batch]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Caches | None = None,
        logits_to_keep: int = 0,
        mixed: bool = False,
    ) -> torch.Tensor:
        """Return logits (k+1, B, T', V): the batch runs once, replicated per component.

        `mixed`: the output layer's input is mixed to B rows (a hook of `MixedHead`, kernels/mixed_head.py); the
        logits are then (1, B, T', V)."""
        n = len(self.components)
        batch = input_ids.shape[0]
        kwargs = {} if cache is None else {self.cache_kwarg: cache[0], "use_cache": True}
        inputs = dict(
            input_ids=input_ids.repeat(n, 1),  # ((k+1)·B, T')
            attention_mask=attention_mask.repeat(n, *[1] * (attention_mask.dim() - 1)),  # 2D, or 4D (B, 1, T', C)
            position_ids=position_ids.repeat(n, 1),
            logits_to_keep=logits_to_keep,
            **kwargs,
        )
        if self.stacked is not None:
            with self.stacked.active():
                logits = self.model(**inputs).logits  # ((k+1)·B, T', V)
        else:
            logits = self.model(**inputs, adapter_names=self._adapter_names(batch)).logits
        return logits.view(1 if mixed else n, batch, *logits.shape[1:])  # (k+1, B, T', V), or (1, B, T', V) mixed
