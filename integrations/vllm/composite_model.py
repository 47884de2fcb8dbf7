"""The composite vLLM model: one vLLM request drives the base and k experts, composed in `compute_logits`.

Imported by vLLM only (through `mergecompose.integrations.vllm.plugin`), in an environment with vLLM; the folder it
reads is written by `mergecompose.integrations.vllm.folder.build_vllm_model`.

* Every component is vLLM's own implementation of the base's architecture (`LlamaForCausalLM`,
  `Gemma2ForCausalLM`, ...), built under its own prefix (`base`, `expert_a`, `expert_b`, ...), so each
  has its own attention layers and so its own paged KV cache: the k+1 components advance in lockstep
  inside one request, under vLLM's scheduler, prefix cache and continuous batching.
* The base and its LoRA experts (the "group", G = 1 + number of LoRA experts) run as one pass of the
  base's layers over their hidden states stacked along the tokens, `(G·tokens, hidden)`: every shared
  weight is read once per step, as in `ComposedLM`'s stacked LoRA. A forward hook on each targeted base
  projection adds member g's `x_g Aᵀ Bᵀ · scaling` to its rows and output slice; each attention layer of
  the base is wrapped in `_StackedAttention`, which hands member g's rows to member g's own attention
  layer (and so its own KV cache). A LoRA expert's model is built only for its attention layers; it
  shares every weight module of the base (no second copy; while it is built, vLLM allocates its own
  weights once, which are dropped at once).
* A full expert loads its own weights from its folder (`secondary_weights`, under its prefix) and runs
  on its own after the group.
* `forward` returns the components' final hidden states side by side, `(tokens, (k+1)·hidden)`;
  `compute_logits` gives each the head of its model (one pass of the base's head for the whole group;
  Gemma-2's final-logit soft-capping included) and returns `compose_logprobs(base, experts, weights)`,
  the rule and -inf semantics of `mergecompose.composition.rule`. vLLM's sampler and its (prompt) log-probs see
  composed log-probs. Tensor parallelism: full experts are sharded like the base; LoRA experts need
  one GPU per model (tensor_parallel_size 1).
"""

from __future__ import annotations

import functools
import itertools
import string
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.models.registry import ModelRegistry
from vllm.model_executor.models.utils import maybe_prefix

from mergecompose.composition.kernels.mixed_head import exponents, row_exponents
from mergecompose.composition.kernels.stopwatch import Choice, Stopwatch, fastest
from mergecompose.composition.rule import compose_logprobs_unchecked
from mergecompose.integrations.vllm.requests import request_weights


class ComposedForCausalLM(nn.Module):
    """log p̂ = log p_b + Σ_i w_i (log p_i − log p_b), renormalised, at every position vLLM computes logits for."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        composition = getattr(config, "composition", None)
        if not isinstance(composition, dict):
            raise ValueError(
                "config.json has no `composition` section; build the folder with `mergecompose vllm-model`"
            )
        experts = composition["experts"]
        if get_pp_group().world_size > 1:
            raise ValueError("a composed model runs without pipeline parallelism (pipeline_parallel_size 1)")
        if get_tensor_model_parallel_world_size() > 1 and any(expert["kind"] == "lora" for expert in experts):
            raise ValueError(
                "LoRA experts run with tensor_parallel_size 1; for tensor parallelism give full experts "
                "(merge each adapter into a checkpoint)"
            )
        component_class, _ = ModelRegistry.resolve_model_cls(
            [composition["base_architecture"]], vllm_config.model_config
        )
        # Sub-model prefixes hold no digit: vLLM reads an attention layer's index as the one integer in its name.
        self.component_names = ["base"] + [f"expert_{_letters(index)}" for index in range(len(experts))]
        self.base = component_class(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "base"))
        self.secondary_weights = [_weights_source(composition["base"], "base")]
        self.group = ["base"]  # the base and the LoRA experts, run as one stacked pass of the base's layers
        adapters = []  # per LoRA expert: {base module name: [(start, end, A, B), ...]}
        for name, expert in zip(self.component_names[1:], experts):
            model = component_class(vllm_config=vllm_config, prefix=maybe_prefix(prefix, name))
            if expert["kind"] == "lora":
                _share_base_modules(model, self.base)
                adapters.append(
                    _lora_pieces(
                        model,
                        Path(expert["path"]),
                        expert["lora_scaling"],
                        component_class,
                        vllm_config.model_config.dtype,
                    )
                )
                self.group.append(name)
            else:
                self.secondary_weights.append(_weights_source(expert["path"], name))
            setattr(self, name, model)
        self.lora_deltas = nn.ModuleList()
        for module_name in sorted({module_name for pieces in adapters for module_name in pieces}):
            members = {
                member: pieces[module_name] for member, pieces in enumerate(adapters, start=1) if module_name in pieces
            }
            delta = _StackedLoRADelta(len(self.group), members)
            self.base.get_submodule(module_name).register_forward_hook(delta.add_to_output)
            self.lora_deltas.append(delta)
        if len(self.group) > 1:
            for module_name, attention in list(self.base.named_modules()):
                if isinstance(attention, AttentionLayerBase):
                    members = [getattr(self, name).get_submodule(module_name) for name in self.group[1:]]
                    _set_module(self.base, module_name, _StackedAttention(attention, members))
        self.register_buffer("weights", torch.tensor(composition["weights"], dtype=torch.float32), persistent=False)
        # Each request's own weights (`integrations/vllm/requests.py`): the engine's `RequestWeights`, found by its
        # config, for the first `compute_logits` after each forward pass (the sampled rows, in the batch's order).
        self.vllm_config_id = id(vllm_config)
        self.rows_in_batch_order = False
        base_first = exponents(composition["weights"], len(experts))  # in the order of component_names
        self.register_buffer("exponents", torch.tensor(base_first, dtype=torch.float32), persistent=False)
        # Mixing the final hidden states before one head pass (`compute_logits`): None, chosen by timing at each row
        # count (a power of two bucket); True or False, fixed (`set_mix_before_head`).
        self.mix_before_head: bool | None = None
        self.mixing: dict[int, Choice] = {}
        logits_processor = getattr(self.base, "logits_processor", None)
        self.can_mix = (
            len(self.group) == len(self.component_names)  # every expert a LoRA expert: one head for all
            and logits_processor is not None
            and getattr(logits_processor, "soft_cap", 1.0) is None  # logits linear in the hidden state
            and not getattr(logits_processor, "logits_as_input", True)
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.base.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs) -> torch.Tensor:
        if inputs_embeds is not None:
            raise ValueError("a composed model takes token ids, not embeddings: each full expert embeds them itself")
        self.rows_in_batch_order = True
        size = len(self.group)
        if size == 1:
            hidden = {"base": self.base(input_ids, positions, intermediate_tensors, None)}
        else:
            embeddings = self.base.embed_input_ids(input_ids)  # (tokens, hidden), shared by the group
            stacked = self.base(
                None, torch.cat([positions] * size, dim=-1), intermediate_tensors, embeddings.repeat(size, 1)
            )  # (G·tokens, hidden)
            hidden = dict(zip(self.group, stacked.chunk(size, dim=0)))
        for name in self.component_names:
            if name not in hidden:  # a full expert
                hidden[name] = getattr(self, name)(input_ids, positions, intermediate_tensors, None)
        return torch.cat([hidden[name] for name in self.component_names], dim=-1)  # (tokens, (k+1)·hidden)

    def set_mix_before_head(self, value: bool | None) -> None:
        """Fix whether `compute_logits` mixes before the head (True, False), or let timing choose (None)."""
        self.mix_before_head = value

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The composed log-probs `(tokens, V)` of the components' final hidden states `(tokens, (k+1)·hidden)`.

        The weights are the folder's, or, in the first call after a forward pass (vLLM's sampled rows, one per
        request in the batch's order) where a request in the batch chose its own experts, each row's request's
        (`requests.py`); later calls of the same step (prompt log-probs) use the folder's. A component that no
        request of the batch gives a weight other than 0 gets no head pass.

        Where every expert is a LoRA expert of the base and the head's logits are linear in the hidden state (no
        soft-capping), the rule is log_softmax(head(Σ_c e_c h_c)) (composition/kernels/mixed_head.py): one head pass
        over the tokens instead of one a component, equal to the rule up to float rounding. Whether that is faster
        here is timed once per bucket of row counts on the first call's own hidden states (kernels/stopwatch.py)."""
        weights = self._row_weights(hidden_states.shape[0])
        if not self.can_mix or self.mix_before_head is False:
            return self._logits_per_component(hidden_states, weights)
        if self.mix_before_head:
            return self._mixed_logits(hidden_states, weights)
        bucket = 1 << max(hidden_states.shape[0] - 1, 0).bit_length()  # 1, 2, 4, 8, ...
        if bucket not in self.mixing:
            options = {
                "mixed": functools.partial(self._mixed_logits, hidden_states, weights),
                "per component": functools.partial(self._logits_per_component, hidden_states, weights),
            }
            self.mixing[bucket] = fastest(options, Stopwatch(), repeats=3)
        if self.mixing[bucket].chosen == "mixed":
            return self._mixed_logits(hidden_states, weights)
        return self._logits_per_component(hidden_states, weights)

    def _row_weights(self, rows: int) -> tuple[torch.Tensor, list[bool]] | None:
        """`((rows, k) weights, per expert whether any row uses it)` where the batch's requests chose their own
        experts and these rows are the batch's sampled rows; None for the folder's weights."""
        in_batch_order, self.rows_in_batch_order = self.rows_in_batch_order, False
        table = request_weights(self.vllm_config_id)
        if not in_batch_order or table is None or not table.chosen or table.batch_size != rows:
            return None
        return table.rows(), table.used()

    def _mixed_logits(self, hidden_states: torch.Tensor, weights=None) -> torch.Tensor:
        size = len(self.component_names)
        stacked = hidden_states.unflatten(-1, (size, -1)).float()  # (tokens, k+1, hidden)
        if weights is None:
            mixed = torch.einsum("c,tch->th", self.exponents, stacked)  # (tokens, hidden)
        else:
            mixed = torch.einsum("tc,tch->th", row_exponents(weights[0]), stacked)  # weights[0]: (tokens, k)
        return torch.log_softmax(self.base.compute_logits(mixed.to(hidden_states.dtype)).float(), dim=-1)

    def _logits_per_component(self, hidden_states: torch.Tensor, weights=None) -> torch.Tensor | None:
        chunks = dict(
            zip(self.component_names, hidden_states.chunk(len(self.component_names), dim=-1))
        )  # (tokens, hidden) each
        experts = self.component_names[1:]
        if weights is None:
            expert_weights: torch.Tensor = self.weights
        else:
            rows, used = weights
            experts = [name for name, in_use in zip(experts, used) if in_use]
            expert_weights = rows[:, used].t()  # (used experts, tokens)
        group = [name for name in self.group if name == "base" or name in experts]
        group_logits = self.base.compute_logits(torch.cat([chunks[name] for name in group]))  # (G·tokens, V)
        if group_logits is None:  # a tensor-parallel rank other than the first
            return None
        logits = dict(zip(group, group_logits.chunk(len(group))))
        for name in experts:
            if name not in logits:
                logits[name] = getattr(self, name).compute_logits(chunks[name])  # (tokens, V)
        return compose_logprobs_unchecked(
            logits["base"], [logits[name] for name in experts], expert_weights
        )  # (tokens, V)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Route each checkpoint tensor (named `<component>.<name>` by its source's prefix) to its component."""
        loaded = set()
        for component, group in itertools.groupby(weights, key=lambda item: item[0].split(".", 1)[0]):
            if component == "composition":  # the folder's own placeholder file
                for _ in group:
                    pass
                continue
            names = getattr(self, component).load_weights((name.split(".", 1)[1], tensor) for name, tensor in group)
            loaded |= {f"{component}.{name}" for name in names or ()}
        return loaded


class _StackedLoRADelta(nn.Module):
    """The LoRA paths of one base projection for a group of G members stacked along the tokens (member 0: the base).

    A forward hook: with x `(G·tokens, in)` and the projection's output `(G·tokens, out)`, member g's rows get
    output[g, :, start:end] += (x_g @ Aᵀ) @ (scaling · B)ᵀ for each of its paths, with A `(r, in)` and B
    `(end − start, r)`. All paths are computed at once, as `ComposedLM`'s stacked LoRA does at a decoding step
    (composition/kernels/stacked_lora.py): their A side by side, `A_all` `(in, R)`, R the sum of their ranks; their B
    in one `(R, hi − lo)` matrix, each path's B in its rows and its output slice's columns, zeros elsewhere
    ([lo, hi) spans every path's slice); then

        output[:, lo:hi] += ((x A_all) ⊙ M) B_all

    where the 0/1 mask M keeps, in member g's rows, the columns of g's own paths (in the base's rows, none): two
    matrix products and a mask a projection, instead of two products a path (six a member for a fused q/k/v). The
    zeros add exactly nothing.
    """

    def __init__(self, size: int, members: dict[int, list[tuple[int, int, torch.Tensor, torch.Tensor]]]):
        super().__init__()
        self.size = size
        paths = [(member, start, end, a, b) for member, pieces in members.items() for start, end, a, b in pieces]
        self.low = min(start for _, start, _, _, _ in paths)
        self.high = max(end for _, _, end, _, _ in paths)
        lora_a = torch.cat([a for _, _, _, a, _ in paths])  # (R, in)
        lora_b = lora_a.new_zeros(lora_a.shape[0], self.high - self.low)  # (R, hi − lo)
        mask = lora_a.new_zeros(size, lora_a.shape[0])  # (G, R)
        row = 0
        for member, start, end, a, b in paths:
            lora_b[row : row + a.shape[0], start - self.low : end - self.low] = b.t()
            mask[member, row : row + a.shape[0]] = 1
            row += a.shape[0]
        self.register_buffer("lora_a", lora_a.t().contiguous(), persistent=False)  # (in, R)
        self.register_buffer("lora_b", lora_b, persistent=False)
        self.register_buffer("mask", mask[:, None, :], persistent=False)  # (G, 1, R)

    def add_to_output(self, module: nn.Module, inputs: tuple, output):
        x = inputs[0]  # (G·tokens, in)
        result = output[0] if isinstance(output, tuple) else output  # (G·tokens, out)
        hidden = (x @ self.lora_a).unflatten(0, (self.size, -1))  # (G, tokens, R)
        hidden.mul_(self.mask)
        result[:, self.low : self.high] += hidden.flatten(0, 1) @ self.lora_b
        return output


class _StackedAttention(nn.Module):
    """The base's attention layer for a group stacked along the tokens: member g's rows go to member g's layer.

    Each member's attention layer holds its own KV cache; the members' layers stay registered in their own
    models (they are not children here)."""

    def __init__(self, attention: nn.Module, members: list[nn.Module]):
        super().__init__()
        self.attention = attention
        self.members = tuple(members)

    def forward(self, query, key, value, output_shape=None, **kwargs):
        layers = (self.attention, *self.members)
        tokens = query.shape[0] // len(layers)
        if output_shape is not None:
            output_shape = torch.Size((tokens, *output_shape[1:]))
        outputs = [
            layer(
                query[index * tokens : (index + 1) * tokens],
                key[index * tokens : (index + 1) * tokens],
                value[index * tokens : (index + 1) * tokens],
                output_shape=output_shape,
                **kwargs,
            )
            for index, layer in enumerate(layers)
        ]  # G × (tokens, heads·head_dim)
        return torch.cat(outputs)  # (G·tokens, heads·head_dim)


def _letters(index: int) -> str:
    """0 → a, 25 → z, 26 → ba: a name without digits."""
    letters = string.ascii_lowercase
    return letters[index] if index < 26 else _letters(index // 26) + letters[index % 26]


def _weights_source(path: str, component: str) -> DefaultModelLoader.Source:
    return DefaultModelLoader.Source(model_or_path=path, revision=None, prefix=f"{component}.", fall_back_to_pt=False)


def _share_base_modules(model: nn.Module, base: nn.Module) -> None:
    """Replace every module of `model` that holds weights by the base's module of the same name.

    Attention layers are kept: they hold the component's own KV cache."""
    base_modules = dict(base.named_modules())
    for name, module in list(model.named_modules()):
        if name and not isinstance(module, AttentionLayerBase) and any(True for _ in module.parameters(recurse=False)):
            _set_module(model, name, base_modules[name])


def _lora_pieces(model: nn.Module, folder: Path, scaling: float, component_class: type, dtype: torch.dtype) -> dict:
    """{vLLM module name: [(start, end, A, scaling · B), ...]}: the output slices of each projection the adapter
    targets (vLLM packs q/k/v and gate/up into one module)."""
    device = next(model.parameters()).device
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    packed = {
        leaf: (fused, index)
        for fused, leaves in getattr(component_class, "packed_modules_mapping", {}).items()
        for index, leaf in enumerate(leaves)
    }
    pieces: dict[str, list] = {}
    for key in sorted(tensors):
        if ".lora_A." not in key:
            continue
        module_path = key.removeprefix("base_model.model.").split(".lora_A.")[0]  # e.g. model.layers.0.self_attn.q_proj
        lora_a = tensors[key].to(device=device, dtype=dtype)  # (r, in)
        lora_b = (tensors[key.replace(".lora_A.", ".lora_B.")] * scaling).to(device=device, dtype=dtype)  # (out, r)
        parent, leaf = module_path.rsplit(".", 1)
        vllm_name, slice_index = (
            (f"{parent}.{packed[leaf][0]}", packed[leaf][1]) if leaf in packed else (module_path, None)
        )
        layer = model.get_submodule(vllm_name)
        sizes = getattr(layer, "output_sizes", None) or [lora_b.shape[0]]
        start = sum(sizes[:slice_index]) if slice_index is not None else 0
        end = start + (sizes[slice_index] if slice_index is not None else sizes[0] if len(sizes) == 1 else sum(sizes))
        if end - start != lora_b.shape[0]:
            raise ValueError(
                f"LoRA adapter {str(folder)!r}: `{key}` gives {lora_b.shape[0]} outputs, the model's "
                f"`{vllm_name}` slice has {end - start}"
            )
        pieces.setdefault(vllm_name, []).append((start, end, lora_a, lora_b))
    return pieces


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)
