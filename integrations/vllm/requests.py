"""Per-request experts in vLLM: the logits processor that carries each request's weights to the composite model.

vLLM's model never sees a request's `SamplingParams`; a v1 logits processor does (`update_state`, with the
batch's additions, removals and moves), and it runs in the model's worker process. `ExpertChoice` keeps one row
of weights per request, in the batch's order (`RequestWeights`), which `ComposedForCausalLM.compute_logits`
reads: vLLM's V1 model runner calls every processor's `update_state` before the forward pass
(`InputBatch.refresh_metadata`, from `GPUModelRunner._update_states`), and computes the sampled rows' logits in
the batch's order, one row per request, in the same call (`execute_model`). The processor's own `apply` changes
nothing: the logits it gets are composed already.

The processor is added to a composite model's engine only: `plugin.ComposedConfig.verify_and_update_config`, which
`plugin.register` puts into vLLM's per-architecture config hooks (`MODELS_CONFIG_MAP`, run by
`VllmConfig.__post_init__`), appends its import path to `model_config.logits_processors`. So `vllm serve DIR` needs
no flag, and other models served beside mergecompose get no processor. The same hook records the folder's expert
names (`plugin.SERVED_EXPERTS`) for `validate_params`, which vLLM runs in the server's process before a request is
admitted (a ValueError there is an HTTP 400).

What `validate_params` sees is not always what the request sent. The OpenAI server first validates the JSON body
with its request model, `vllm_xargs: dict[str, str | int | float | list[str | int | float]]`
(`vllm/entrypoints/openai/completion/protocol.py`, and the chat and responses protocols): pydantic converts a JSON
`true`/`false` to 1/0 there (in a list too), so a boolean weight reaches the parser as a number; and it refuses
`null`, an object or a nested list before any processor runs, with vLLM's own multi-line "N validation errors"
400 (`serve/exception_handling/handlers/validation.py`). Then `SamplingParams.__post_init__` refuses an integer
outside [-2**63, 2**64) in `extra_args` ("extra_args integers must be between ...", one line). What passes
reaches `parse_expert_choice` unchanged (`to_sampling_params` hands `vllm_xargs` over as `extra_args`).

vLLM's V2 model runner (its default where Triton is installed, e.g. on GPUs) gives a processor the batch's order
only in `apply`, after `compute_logits` (`vllm/v1/worker/gpu/sample/logits_processor/interface.py`,
`LogitsContext`): there a request that names experts is refused with one line (`ExpertChoiceV2`), and the folder's
weights serve every other request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as LogitsProcessorV2

from mergecompose.integrations.vllm.choice import EXPERTS_KEY, WEIGHTS_KEY, check_keys, parse_expert_choice
from mergecompose.integrations.vllm.plugin import SERVED_EXPERTS

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig


class RequestWeights:
    """The weights `w_i` of each request in the batch, in the batch's order: `rows()` is `(batch size, k)`."""

    def __init__(self, names: list[str], defaults: list[float], max_rows: int, device: torch.device):
        self.names = list(names)
        self.defaults = tuple(defaults)
        self.batch_size = 0
        self.chosen: dict[int, tuple[float, ...]] = {}  # batch index -> weights, for requests that name experts
        self._table = torch.tensor([self.defaults] * max_rows, dtype=torch.float32, device=device)  # (max_rows, k)
        self._used = [True] * len(defaults)
        self._stale = False
        self.moves = 0  # rows vLLM moved within the batch so far (a request finished while others ran on)

    def update(self, batch_update: BatchUpdate | None) -> None:
        """Follow the batch's additions, removals and moves (vLLM's order: removed, added, moved)."""
        if batch_update is None:
            return
        self.batch_size = batch_update.batch_size
        self.moves += len(batch_update.moved)
        process_dict_updates(self.chosen, batch_update, self._chosen_weights)
        self._stale = True

    def rows(self) -> torch.Tensor:
        """`(batch size, k)`: each request's weights (the folder's where it names no expert)."""
        if self._stale:
            self._table[: self.batch_size] = torch.tensor(self.defaults)
            for index, weights in self.chosen.items():
                if index < self.batch_size:
                    self._table[index] = torch.tensor(weights)
            rows = [self.chosen.get(index, self.defaults) for index in range(self.batch_size)]
            self._used = [any(row[expert] != 0 for row in rows) for expert in range(len(self.defaults))]
            self._stale = False
        return self._table[: self.batch_size]

    def _chosen_weights(self, params: SamplingParams, prompt_ids, output_ids) -> tuple[float, ...] | None:
        weights = parse_expert_choice(params.extra_args, self.names)  # checked before admission (validate_params)
        return None if weights is None else tuple(weights)

    def used(self) -> list[bool]:
        """Per expert: whether any request in the batch gives it a weight other than 0."""
        self.rows()
        return list(self._used)


class ExpertChoice(LogitsProcessor):
    """The V1 logits processor of a composite model: each request's experts and weights (`choice.py`)."""

    # The `RequestWeights` of each engine in this process, by the id of its `VllmConfig`, which the composite model
    # is given too.
    tables: dict[int, RequestWeights] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams):
        """Parse the request's choice (`choice.parse_expert_choice`) in the server's process, before admission: vLLM
        turns the one-line ValueError into `VLLMValidationError`, an HTTP 400. It sees `extra_args` as vLLM's request
        model left them (see the module's docstring): JSON booleans already 0/1, nested values already refused."""
        parse_expert_choice(sampling_params.extra_args, SERVED_EXPERTS, prompt_logprobs=sampling_params.prompt_logprobs)

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        composition = vllm_config.model_config.hf_config.composition
        self.table = RequestWeights(
            [expert["name"] for expert in composition["experts"]],
            [float(weight) for weight in composition["weights"]],
            vllm_config.scheduler_config.max_num_seqs,
            device,
        )
        type(self).tables[id(vllm_config)] = self.table

    def is_argmax_invariant(self) -> bool:
        return True  # `apply` changes nothing

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.table.update(batch_update)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


class ExpertChoiceV2(LogitsProcessorV2):
    """Under vLLM's V2 model runner: refuses a request that names experts (the batch's order reaches a processor
    only after `compute_logits`), so that no request silently gets the folder's weights instead of its own."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        extra_args = sampling_params.extra_args or {}
        check_keys(extra_args)  # a misspelt key is refused here too, not served with the folder's weights
        if EXPERTS_KEY in extra_args or WEIGHTS_KEY in extra_args:
            raise ValueError(
                f"per-request `{EXPERTS_KEY}` and `{WEIGHTS_KEY}` need vLLM's V1 model runner: start the server with "
                "VLLM_USE_V2_MODEL_RUNNER=0, or send the request without them (the server's own weights)"
            )

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        return False

    def apply(self, logits, ctx):
        return logits


def request_weights(config_id: int) -> RequestWeights | None:
    """The `RequestWeights` of the engine whose `VllmConfig` has this id (None without the processor, e.g. under
    V2). Looked up at each use: vLLM may build the processors again after the model (a new input batch once the KV
    cache is sized)."""
    return ExpertChoice.tables.get(config_id)
