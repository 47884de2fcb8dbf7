"""The model edge of the analysis: run a `ComposedLM` (and a merge) over batches, stream the diagnostics.

Three things can be measured, each with `measure_overlap` on different sequences:

* teacher-forced on given text (`mergecompose.analysis.data.make_batches`);
* the composed model's own rollouts (`rollout_batches(..., source="composed")`), whose prefixes
  no expert saw in training (e.g. both letters already replaced);
* each expert's rollouts (`source=<expert name>`), or the base's (`source="base"`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from mergecompose.analysis.overlap_settings import OverlapSettings
from mergecompose.analysis.parameters import parameter_overlap
from mergecompose.analysis.streaming import OverlapAccumulator, OverlapReport
from mergecompose.composition import ComposedLM, compose_with_remedies
from mergecompose.composition.inputs import as_mask, as_token_ids
from mergecompose.composition.rule import check_weights


def batch_tensors(batch, index: int) -> dict:
    """Batch `index` with its tensors checked: `input_ids` `(B, T)`, and `attention_mask` and `measure_mask`
    (0/1) of that shape where given; lists are converted. Other keys are passed on as they are."""
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"batch {index} must be a mapping of names to tensors (`input_ids`, ...), got {type(batch).__name__}"
        )
    if batch.get("input_ids") is None:
        raise ValueError(
            f"batch {index} has no `input_ids` (its keys: {sorted(map(str, batch))}); a batch maps `input_ids` (B, T) "
            "and optionally `attention_mask`, `measure_mask`, `position_ids` to tensors"
        )
    checked = dict(batch)
    try:
        checked["input_ids"] = as_token_ids(batch["input_ids"])
        for name in ("attention_mask", "measure_mask"):
            if batch.get(name) is not None:
                checked[name] = as_mask(batch[name], checked["input_ids"].shape, name)
        if batch.get("position_ids") is not None:
            checked["position_ids"] = as_token_ids(batch["position_ids"], "position_ids")
    except (TypeError, ValueError) as error:
        raise type(error)(f"batch {index}: {error}") from None
    return checked


@torch.no_grad()
def model_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Teacher-forced log-probs `(B, T, V)` of one causal LM, with the positions `ComposedLM` uses.

    Position ids default to skipping left padding (0 at each row's first real token), as
    `ComposedLM` does, so a merged model is scored on exactly the positions the components see.
    """
    device = next(model.parameters()).device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    if position_ids is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    position_ids = position_ids.to(device)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)


def measure_overlap(
    composed: ComposedLM,
    batches: Iterable[Mapping[str, torch.Tensor]],
    merged_model: torch.nn.Module | None = None,
    scaled_expert_models: Sequence[torch.nn.Module] | None = None,
    settings: OverlapSettings | None = None,
    task_vectors: Mapping[str, object] | None = None,
    parameter_density: float = 0.2,
    tokenizer: PreTrainedTokenizerBase | None = None,
    progress: bool = True,
    description: str = "overlap",
) -> OverlapReport:
    """Stream the overlap, projectivity and merge ≈ compose diagnostics over `batches`.

    Args:
        composed: the base and its k experts; `composed.weights` (default 1 each) are the
            exponents of the composition, and the λ of the merge being compared. q is what
            `composed` itself composes (`compose_with_remedies` with its weights and remedies).
        batches: dicts with `input_ids` `(B, T)`, optional `attention_mask` `(B, T)`, optional
            `position_ids` `(B, T)` and optional `measure_mask` `(B, T)` bool (the positions to
            measure; default the attention mask).
        merged_model: the task-arithmetic merge `θ_b + λ Σ_i τ_i` as a causal LM, optional; gives
            `merge_compose_gap` (and, with λ = 1 or `scaled_expert_models`, the interaction
            residual).
        scaled_expert_models: k causal LMs at `θ_b + λτ_i`, optional; give the single-expert
            linearization error when λ ≠ 1.
        settings: thresholds and sizes (`OverlapSettings`).
        task_vectors: `{expert name: mergecompose.merging.TaskVector}`, optional; adds each pair's
            parameter-space measures (`mergecompose.analysis.parameters.parameter_overlap` at
            `parameter_density`) under `pairs[...]["parameter"]`, next to its output overlap.
        tokenizer: optional, to print tokens instead of ids in the report.

    Returns:
        An `OverlapReport`; `.to_dict()` holds the overlap.json keys.
    """
    if not isinstance(composed, ComposedLM):
        raise ValueError(f"`composed` must be a ComposedLM, got {type(composed).__name__}")
    if task_vectors is not None and not (isinstance(parameter_density, (int, float)) and 0 < parameter_density <= 1):
        raise ValueError(
            f"`parameter_density` must be in (0, 1], got {parameter_density!r}"
        )  # before, not after, measuring
    if scaled_expert_models is not None and len(scaled_expert_models) != composed.num_experts:
        raise ValueError(
            f"`scaled_expert_models` must hold one model per expert ({composed.num_experts}), "
            f"got {len(scaled_expert_models)}"
        )
    tokenizer = tokenizer if tokenizer is not None else composed.tokenizer
    decode = None if tokenizer is None else (lambda ids: tokenizer.decode(ids))
    accumulator = None
    batches_seen = rows = 0
    for index, batch in enumerate(tqdm(batches, desc=description, disable=not progress, leave=False)):
        batch = batch_tensors(batch, index)
        batches_seen, rows = batches_seen + 1, rows + batch["input_ids"].shape[0]
        input_ids = batch["input_ids"]
        attention_mask = batch.get("attention_mask")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = batch.get("measure_mask")
        mask = attention_mask.bool() if mask is None else mask.bool() & attention_mask.bool()
        position_ids = batch.get("position_ids")
        components = composed.component_logprobs(input_ids, attention_mask, position_ids)  # (k+1, B, T, V)
        if accumulator is None:
            accumulator = OverlapAccumulator(
                composed.expert_names, components.shape[-1], composed.weights, settings, decode=decode
            )
        composed_logprobs = compose_with_remedies(components, composed.weights, composed.remedies)  # (B, T, V)
        merged = None if merged_model is None else model_logprobs(merged_model, input_ids, attention_mask, position_ids)
        scaled = None
        if scaled_expert_models is not None:
            scaled = torch.stack(
                [model_logprobs(m, input_ids, attention_mask, position_ids) for m in scaled_expert_models]
            )
        accumulator.update(
            components,
            mask.to(components.device),
            composed=composed_logprobs,
            merged=None if merged is None else merged.to(components.device),
            scaled_experts=None if scaled is None else scaled.to(components.device),
            input_ids=input_ids.to(components.device),
            attention_mask=attention_mask.to(components.device),
        )
    if accumulator is None:
        raise ValueError("`batches` is empty; nothing to measure")
    if accumulator.positions == 0:
        raise ValueError(
            f"nothing was measured: `measure_mask` (with `attention_mask`) selects no position in the {batches_seen} "
            f"batches ({rows} rows); mark the positions to measure with 1"
        )
    report = accumulator.report()
    if task_vectors is not None:
        if list(task_vectors) != list(composed.expert_names):
            raise ValueError(
                f"`task_vectors` must be keyed by the expert names {composed.expert_names} in that order, "
                f"got {list(task_vectors)}"
            )
        for key, measures in parameter_overlap(task_vectors, parameter_density).items():
            report.pairs[key]["parameter"] = measures
    return report


def with_weights(composed: ComposedLM, weights: Sequence[float]) -> ComposedLM:
    """A shallow copy of `composed` (same models, same backend) with other exponents and no remedies."""
    other = copy.copy(composed)
    other.weights = check_weights(weights, composed.num_experts)
    other.remedies = ()
    return other


def rollout_source(composed: ComposedLM, source: str) -> ComposedLM:
    """The decoder for `source`: "composed", "base", or an expert's name.

    A single component is decoded through the composition rule with one-hot exponents: with
    `w_i = 1` and every other `w_j = 0`, the base's exponent `1 − Σw` is 0 and the rule returns
    `log p_i` exactly; all zeros return `log p_b`.
    """
    if source == "composed":
        return composed
    if source == "base":
        return with_weights(composed, [0.0] * composed.num_experts)
    if source in composed.expert_names:
        index = composed.expert_names.index(source)
        return with_weights(composed, [float(i == index) for i in range(composed.num_experts)])
    raise ValueError(f"`source` must be 'composed', 'base' or an expert name {composed.expert_names}, got {source!r}")


@torch.no_grad()
def rollout_batches(
    composed: ComposedLM,
    prompt_batches: Iterable[Mapping[str, torch.Tensor]],
    source: str = "composed",
    max_new_tokens: int = 32,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Greedy rollouts of `source` from each prompt, as batches ready for `measure_overlap`.

    A prompt batch holds `input_ids` and `attention_mask` `(B, P)` (left-padded), and optionally
    `position_ids` `(B, P)` and `generated_position_ids` `(B, ≥ max_new_tokens)` for tasks that
    place tokens at explicit positions (e.g. position coupling); the rollout batch then carries
    the full `position_ids` `(B, P + n)`.

    The measured positions are those whose distribution produced a generated token: from the
    prompt's last token to the token before the last generated one (EOS included, padding
    after EOS excluded).
    """
    decoder = rollout_source(composed, source)
    if eos_token_id is None and composed.generation_config is not None:
        eos_token_id = composed.generation_config.eos_token_id
    eos_ids = None
    if eos_token_id is not None:
        eos_ids = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    batches = []
    for index, batch in enumerate(prompt_batches):
        batch = batch_tensors(batch, index)
        prompt, prompt_mask = batch["input_ids"], batch.get("attention_mask")
        if prompt_mask is None:
            prompt_mask = torch.ones_like(prompt)
        positions, generated_positions = batch.get("position_ids"), batch.get("generated_position_ids")
        extra = {}
        if positions is not None:
            extra["position_ids"] = positions
        if generated_positions is not None:
            extra["generated_position_ids"] = generated_positions[:, :max_new_tokens]
        sequences = decoder.generate(
            prompt,
            prompt_mask,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            **extra,
        ).cpu()  # (B, P + n)
        prompt_length = prompt.shape[1]
        generated = sequences[:, prompt_length:]  # (B, n)
        # A generated token is real up to and including the first EOS.
        if eos_ids is None:
            real = torch.ones_like(generated, dtype=torch.bool)
        else:
            is_eos = torch.isin(generated, eos_ids)
            real = (is_eos.long().cumsum(-1) - is_eos.long()) == 0
        attention = torch.cat([prompt_mask.cpu().long(), real.long()], dim=1)  # (B, P + n)
        measured = torch.zeros_like(attention, dtype=torch.bool)
        # Column c's distribution produced token c+1: measure c = P−1 … last real generated − 1.
        measured[:, prompt_length - 1 : -1] = real
        rolled = {"input_ids": sequences, "attention_mask": attention, "measure_mask": measured}
        if positions is not None:
            n = generated.shape[1]
            if generated_positions is not None:
                tail = generated_positions[:, :n].cpu()
            else:
                tail = positions[:, -1:].cpu() + 1 + torch.arange(n)
            rolled["position_ids"] = torch.cat([positions.cpu(), tail], dim=1)  # (B, P + n)
        batches.append(rolled)
    return batches
