"""What a compare scores: a `System` is a name, how to load the model that is scored, and what its cached scores
depend on. One notion for both compares:

* `mergecompose compare` (`mergecompose.experiments.compare`) loads each system's model in memory, a
  `SingleModel` or a `ComposedModel`, and scores it by exact match (`mergecompose.experiments.evaluate.score`);
* a `type: lm_eval` compare (`mergecompose.experiments.lm_eval`) loads an lm-eval model (`LmEvalModel`) only
  where a cell is not on disk yet, and scores it with lm-eval, cell by cell, keyed by the system's `identity`.

Both choose merges with `mergecompose.experiments.merge_selection`, where the merge at each grid point
is one more system. Names, shared by both:

    base                   the base
    expert:<name>          an expert (`expert:<name>:lora`: the native compare's LoRA adapter of it)
    compose, compose:lora  the native compare's compositions (an lm-eval compare names each of its own)
    compose+<remedies>     the composition with the config's remedy set <remedies>
    merge:<method>         a merge at its chosen grid point; `merge:<method>@<params>` at one grid point
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel

from mergecompose.composition import ComposedLM
from mergecompose.experiments.formats import Batch, Prompt

BASE = "base"


def expert_name(expert: str, lora: bool = False) -> str:
    return f"expert:{expert}:lora" if lora else f"expert:{expert}"


def remedy_name(remedies: str) -> str:
    """The composition with the named remedy set (`mergecompose.composition.remedies.RemedySettings`)."""
    return f"compose+{remedies}"


def merge_name(method: str, params: Mapping[str, object] | None = None) -> str:
    """`merge:<method>`, or at one grid point `merge:<method>@key=value,...` (`@default` without parameters)."""
    if params is None:
        return f"merge:{method}"
    return f"merge:{method}@" + (",".join(f"{key}={value}" for key, value in params.items()) or "default")


@dataclass(frozen=True)
class System:
    """One system under test: its `name`, `load()` (builds the model that is scored) and `identity` (what a
    cached score of it depends on; empty where nothing is cached)."""

    name: str
    load: Callable[[], Any] = field(repr=False)
    identity: Mapping[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------- models in memory


class ScoredModel(Protocol):
    """What exact match and greedy decoding ask of a loaded model (`mergecompose.experiments.evaluate`)."""

    def logprobs(self, batch: Batch) -> torch.Tensor: ...

    def generate(self, prompt: Prompt, max_new_tokens: int, eos_id: int, pad_id: int) -> torch.Tensor: ...


class SingleModel:
    """One causal LM (a base, a full expert, a peft LoRA expert or a merged model)."""

    def __init__(self, model: PreTrainedModel):
        self.model = model.eval()

    @torch.no_grad()
    def logprobs(self, batch: Batch) -> torch.Tensor:
        logits = self.model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits  # (B, T, V)
        return torch.log_softmax(logits.float(), dim=-1)

    @torch.no_grad()
    def generate(self, prompt: Prompt, max_new_tokens: int, eos_id: int, pad_id: int) -> torch.Tensor:
        """Greedy tokens `(B, ≤ max_new_tokens)` after the prompt (transformers' `generate`).

        transformers continues the prompt's `position_ids` by one per generated token, which
        is `prompt.generated_position_ids` (checked here)."""
        expected = prompt.position_ids[:, -1:] + 1 + torch.arange(max_new_tokens)
        if not torch.equal(prompt.generated_position_ids[:, :max_new_tokens], expected):
            raise ValueError("these prompts need explicit generated positions; transformers' generate continues by one")
        output = self.model.generate(
            input_ids=prompt.input_ids,
            attention_mask=prompt.attention_mask,
            position_ids=prompt.position_ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
        )
        return output[:, prompt.input_ids.shape[1] :]


class ComposedModel:
    """A `ComposedLM`: log p̂ = log p_b + Σ_i (log p_i − log p_b), renormalised, per position."""

    def __init__(self, composed: ComposedLM):
        self.composed = composed

    @torch.no_grad()
    def logprobs(self, batch: Batch) -> torch.Tensor:
        return self.composed.logprobs(batch.input_ids, batch.attention_mask, batch.position_ids)  # (B, T, V)

    @torch.no_grad()
    def generate(self, prompt: Prompt, max_new_tokens: int, eos_id: int, pad_id: int) -> torch.Tensor:
        output = self.composed.generate(
            prompt.input_ids,
            prompt.attention_mask,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            position_ids=prompt.position_ids,
            generated_position_ids=prompt.generated_position_ids[:, :max_new_tokens],
        )
        return output[:, prompt.input_ids.shape[1] :]
