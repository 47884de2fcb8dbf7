"""The rule before the output layer: with LoRA experts on one base, mix the last hidden states, then one head pass.

When every component ends in the same linear output layer (LoRA experts that leave it alone), its logits are
z_c = W h_c (+ b), and the rule is linear in them: with the base's exponent 1 − Σ_i w_i and the experts' w_i,

    log p̂ = log_softmax(Σ_c e_c · log_softmax(z_c)) = log_softmax(Σ_c e_c · z_c) = log_softmax(W Σ_c e_c h_c + b)

since each log_softmax only subtracts a constant per row, and Σ_c e_c = 1 carries the bias. So a pass mixes
the k+1 rows of each position's final hidden state and runs the output layer over B rows instead of (k+1)·B,
and no component's log-softmax over V is taken. This equals the rule (rule.py) up to float rounding where every
component's log-probs lie above the rule's floor (−1e4), as a real model's finite logits do; it is used only
without remedies (they need each component's distribution), and only where the model's logits are its output
layer's output, unchanged (`head_is_last`: no soft-capping or scaling after it, e.g. Gemma-2's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from mergecompose.composition.backend import Backend, Caches
from mergecompose.composition.kernels.few_row_kernel import x_wt
from mergecompose.composition.kernels.packed_weights import trim_heap
from mergecompose.composition.kernels.stopwatch import Choice, Stopwatch, fastest
from mergecompose.composition.remedies import step_composer
from mergecompose.composition.rule import check_scores
from mergecompose.composition.shared_adapters import SharedAdapters


def exponents(weights: Sequence[float] | None, num_experts: int) -> list[float]:
    """The rule's exponent of each component, base first: `[1 − Σ w_i, w_1, …, w_k]` (every w_i 1 by default)."""
    expert_weights = [1.0] * num_experts if weights is None else [float(weight) for weight in weights]
    return [1.0 - sum(expert_weights), *expert_weights]


def row_exponents(weights: torch.Tensor) -> torch.Tensor:
    """`exponents` of each row's weights `(rows, k)`: `(rows, k+1)`, base first (per-request weights in vLLM)."""
    return torch.cat([1.0 - weights.sum(dim=1, keepdim=True), weights], dim=1)


def head_is_last(model: PreTrainedModel) -> bool:
    """True if `model`'s logits are its output layer's output as it is, checked on a few tokens (ids 1-3: id 0
    is often padding, whose embedding can be zero and its logits too, whatever comes after the layer).

    A forward hook keeps the output layer's output; a model that changes the logits after it (soft-capping,
    a scale) or has no output layer module gives False."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return False
    seen: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda module, args, output: seen.append(output))
    try:
        with torch.no_grad():
            tokens = torch.arange(1, 4, device=head.weight.device).clamp(max=head.weight.shape[0] - 1)[None]  # (1, 3)
            logits = model(input_ids=tokens, use_cache=False).logits
    finally:
        handle.remove()
    return len(seen) == 1 and logits.shape == seen[0].shape and torch.equal(logits, seen[0])


def can_mix(backend: object) -> bool:
    """True if `backend` runs LoRA experts with stacked products, none of them on the output layer, and the
    model's logits are that layer's output (`head_is_last`)."""
    if not isinstance(backend, SharedAdapters) or backend.stacked is None:
        return False
    head = backend.base_model.get_output_embeddings()
    paths = {module: path for path, module in backend.base_model.named_modules()}
    if head is None or paths.get(head) in backend.stacked.factors:
        return False
    return head_is_last(backend.base_model)


class MixedHead:
    """A `SharedAdapters` backend whose passes give the composed logits `(1, B, T', V)` (module docstring).

    A forward pre-hook on the output layer, on only during this backend's passes, replaces its input
    `((k+1)·B, T', H)` by `Σ_c e_c h_c` `(B, T', H)`, mixed in float32. Everything else is the backend's."""

    def __init__(self, backend: SharedAdapters, component_exponents: Sequence[float]) -> None:
        self.backend = backend
        head = backend.base_model.get_output_embeddings()
        self._exponents = torch.tensor(list(component_exponents), dtype=torch.float32, device=backend.device)
        self._on = False
        self._handle = head.register_forward_pre_hook(self._mix)

    def _mix(self, module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        if not self._on:
            return None
        hidden = args[0]  # ((k+1)·B, T', H)
        n = self._exponents.shape[0]
        stacked = hidden.view(n, hidden.shape[0] // n, *hidden.shape[1:]).float()  # (k+1, B, T', H)
        mixed = torch.tensordot(self._exponents, stacked, dims=1)  # (B, T', H)
        return (mixed.to(hidden.dtype), *args[1:])

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def base_model(self) -> PreTrainedModel:
        return self.backend.base_model

    @property
    def models(self) -> list[PreTrainedModel]:
        return self.backend.models

    @property
    def shares_one_base(self) -> bool:
        return True

    def new_cache(self, length: int | None = None) -> Caches:
        return self.backend.new_cache(length)

    def keep_rows(self, caches: Caches, rows: torch.Tensor, batch: int) -> None:
        self.backend.keep_rows(caches, rows, batch)

    def merged_draft(self, lambdas: Sequence[float]) -> PreTrainedModel:
        return self.backend.merged_draft(lambdas)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Caches | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """The composed logits `(1, B, T', V)`: one "component", the mixture."""
        self._on = True
        try:
            return self.backend.forward(input_ids, attention_mask, position_ids, cache, logits_to_keep, mixed=True)
        finally:
            self._on = False

    def close(self) -> None:
        """Remove the hook (the backend stays open: it belongs to its ComposedLM); idempotent."""
        self._handle.remove()


def measure_mixing(
    head: torch.nn.Linear,
    weights: Sequence[float] | None,
    num_experts: int,
    batch: int,
    stopwatch: Stopwatch,
    repeats: int = 5,
) -> Choice:
    """Whether mixing before the output layer `head` is faster here at `batch` rows a step: "mixed" or "per component".

    Times, on seeded random final hidden states of the k+1 components (`batch` rows each), the work the two ways
    differ in: the mix, one output-layer product over `batch` rows and one log-softmax, against the output layer over
    (k+1)·`batch` rows and the rule on every component's logits (`step_composer`, as `decoding_backend` gives it). The
    layer's product is oneDNN's dense one (`x_wt`), as in a pass."""
    weight, bias = head.weight.detach(), None if head.bias is None else head.bias.detach()
    component_exponents = exponents(weights, num_experts)
    n = len(component_exponents)
    rule = step_composer(weights, (), weight.shape[0], checked=False)
    generator = torch.Generator().manual_seed(batch)
    hidden = torch.randn(n * batch, weight.shape[1], generator=generator).to(weight.device, weight.dtype)
    mix = torch.tensor(list(component_exponents), dtype=torch.float32, device=weight.device)
    sync = torch.cuda.synchronize if weight.device.type == "cuda" else (lambda: None)

    def mixed() -> None:
        mixed = torch.tensordot(mix, hidden.view(n, batch, -1).float(), dims=1).to(hidden.dtype)  # (B, H)
        compose_mixed(x_wt(mixed, weight, bias)[None])
        sync()

    def per_component() -> None:
        logits = x_wt(hidden, weight, bias).view(n, batch, -1)  # (k+1, B, V)
        rule(logits)
        sync()

    with torch.no_grad():
        choice = fastest({"mixed": mixed, "per component": per_component}, stopwatch, repeats)
    trim_heap()  # the trial's logits and log-probs
    return choice


def compose_mixed(logits: torch.Tensor) -> torch.Tensor:
    """`(1, ..., V)` logits of the mixed hidden state -> `(..., V)` float32 composed log-probs (module docstring)."""
    return torch.log_softmax(logits[0].float(), dim=-1)


def compose_mixed_checked(logits: torch.Tensor) -> torch.Tensor:
    """`compose_mixed`, refusing NaN and +inf in the logits first (for sampling: NaN must not reach the sampler)."""
    check_scores(logits, "the mixed components' logits")
    return compose_mixed(logits)


def decoding_backend(
    backend: Backend,
    mix: bool,
    weights: Sequence[float] | None,
    num_experts: int,
    remedies: Sequence[object],
    vocab_size: int,
    do_sample: bool,
) -> tuple[Backend, Callable[[torch.Tensor], torch.Tensor]]:
    """What a decoding loop runs, and the rule of each step (`(k+1, B, V)` -> `(B, V)`): with `mix` (LoRA experts on
    one base, no remedies, a backend that allows it), the mixed head, whose one output-layer pass gives the
    composed logits (`close()` it after); else `backend` itself with the rule and the remedies."""
    if mix and isinstance(backend, SharedAdapters):
        return MixedHead(
            backend, exponents(weights, num_experts)
        ), compose_mixed_checked if do_sample else compose_mixed
    return backend, step_composer(weights, remedies, vocab_size, checked=do_sample)
