"""The backend of full expert checkpoints: k+1 models, run one after another, each with its own KV cache.

Their plain linears use the few-row kernel (kernels/few_row_linear.py) while a pass runs: speculative decoding verifies
K+1 tokens a row, and a batch of B rows decodes B rows a step."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from mergecompose.composition.architecture import cache_kwarg
from mergecompose.composition.backend import Caches
from mergecompose.composition.kernels.few_row_kernel import FewRowKernel
from mergecompose.composition.kernels.few_row_linear import FewRowLinears
from mergecompose.composition.kv_cache import GrowingCache
from mergecompose.composition.speculative.drafts import merged_full_draft


class SeparateModels:
    """k+1 full models, base first (a draft model is one of them alone).

    The forwards of their plain `nn.Linear` modules are replaced until `close()` (`FewRowLinears`), which
    gives them back; outside this backend's passes the replaced forward is F.linear. `kernel`: the
    few-row kernel's choice to share, e.g. across the drafts of one composition; default a new one."""

    def __init__(self, models: Sequence[PreTrainedModel], kernel: FewRowKernel | None = None) -> None:
        self.models = list(models)
        self.cache_kwargs = [cache_kwarg(model) for model in self.models]
        self.linears = FewRowLinears.of_models(self.models, kernel)

    @property
    def device(self) -> torch.device:
        return self.models[0].device

    @property
    def base_model(self) -> PreTrainedModel:
        return self.models[0]

    @property
    def shares_one_base(self) -> bool:
        return False

    def new_cache(self, length: int | None = None) -> Caches:
        return [GrowingCache(model.config, length) for model in self.models]

    def keep_rows(self, caches: Caches, rows: torch.Tensor, batch: int) -> None:
        for cache in caches:
            cache.batch_select_indices(rows)

    def close(self) -> None:
        """Give every linear its own forward back; idempotent."""
        self.linears.close()

    def merged_draft(self, lambdas: Sequence[float]) -> PreTrainedModel:
        return merged_full_draft(self.models[0], self.models[1:], lambdas)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Caches | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Return logits (k+1, B, T', V) for every component, base first."""
        outputs = []
        for index, model in enumerate(self.models):
            kwargs = {} if cache is None else {self.cache_kwargs[index]: cache[index], "use_cache": True}
            with self.linears.active():
                logits = model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    logits_to_keep=logits_to_keep,
                    **kwargs,
                ).logits  # (B, T', V)
            outputs.append(logits)
        return torch.stack(outputs)  # (k+1, B, T', V)
