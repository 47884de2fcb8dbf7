"""All LoRA experts on one base, their products computed with one batched matmul per module.

peft's mixed-adapter batch (`adapter_names=[...]`) gathers each adapter's rows with Python index
lists and runs two small matmuls per adapter per module, and its forward hooks walk every module
on every call. Here the batch is laid out component-major — rows `[base | expert_1 | … | expert_k]`,
B rows each — so each expert's rows are a contiguous slice, and for every targeted linear layer

    y = W x                                  (all (k+1)·B rows, the base weight read once)
    y[expert i rows] += s_i · B_i A_i x      (i = 1..k, as two `bmm` over the stacked experts)

The factors come from the adapters that peft loaded; the LoRA layers are then unloaded
(`PeftModel.unload`, no merge) so the base model is plain again, and forward hooks on the base
linears add the stacked products while `active()` is on. `close()` removes the hooks and gives
every module its own forward back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as LoraLinear

# Up to this many rows, a CPU linear is computed as W @ xᵀ (see `_linear_forward`).
_FEW_ROWS = 64

# A_t (p, in, r_max), B_t (p, r_max, out) and the component index of each of the p experts (p,).
Factors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class StackedLoRAUnsupported(ValueError):
    """The adapters use a feature that the stacked path does not implement (DoRA, embeddings...)."""


class StackedLoRA:
    """Hooks that add k experts' LoRA products to their rows of a component-major batch.

    Args:
        peft_model: a PeftModel holding the adapters named in `adapter_names` (consumed: its LoRA
            layers are unloaded and the plain base model is kept in `self.model`).
        adapter_names: the experts, in component order 1..k.
    """

    def __init__(self, peft_model: Any, adapter_names: Sequence[str]) -> None:
        self.adapter_names = list(adapter_names)
        self.n_components = len(self.adapter_names) + 1
        self._on = False
        stacked: dict[str, Factors] = {}
        for path, module in peft_model.get_base_model().named_modules():
            if not hasattr(module, "lora_A"):
                continue
            if not isinstance(module, LoraLinear):
                raise StackedLoRAUnsupported(f"module `{path}` is a {type(module).__name__} LoRA layer")
            present = [i for i, name in enumerate(self.adapter_names) if name in module.lora_A]
            if not present:
                continue
            if any(self.adapter_names[i] in module.lora_variant for i in present):
                raise StackedLoRAUnsupported(f"module `{path}` uses a LoRA variant (e.g. DoRA)")
            stacked[path] = self._stack(module, [self.adapter_names[i] for i in present], present)
        self.factors = {path: (a_t, b_t) for path, (a_t, b_t, _) in stacked.items()}
        self.model = peft_model.unload()  # the base model with its original layers, unmerged
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        # (module, its instance-level forward before ours or None), for `close()`.
        self._patched: list[tuple[torch.nn.Module, Callable[..., torch.Tensor] | None]] = []
        for path, module in self.model.named_modules():
            if isinstance(module, torch.nn.Linear):
                self._patched.append((module, module.__dict__.get("forward")))
                # An instance attribute: the class's forward is left alone, and `close()` deletes ours.
                module.__dict__["forward"] = self._linear_forward(module, stacked.get(path))
            elif path in stacked:  # e.g. GPT-2's Conv1D: keep its forward, add the products after it
                self._handles.append(module.register_forward_hook(self._hook(*stacked[path])))

    @staticmethod
    def _stack(module: LoraLinear, names: list[str], present: list[int]) -> Factors:
        """A_t: (p, in, r_max), B_t: (p, r_max, out) with the scaling folded into B; zero-padded ranks."""
        a = [_weight(module.lora_A[name]) for name in names]  # (r_j, in) each
        b = [_weight(module.lora_B[name]) for name in names]  # (out, r_j) each
        ranks = [weight.shape[0] for weight in a]
        in_features, out_features = a[0].shape[1], b[0].shape[0]
        weight = a[0]
        a_t = torch.zeros(len(names), in_features, max(ranks), dtype=weight.dtype, device=weight.device)
        b_t = torch.zeros(len(names), max(ranks), out_features, dtype=weight.dtype, device=weight.device)
        for j, name in enumerate(names):
            rank = ranks[j]
            a_t[j, :, :rank] = a[j].detach().T
            b_t[j, :rank, :] = (b[j].detach() * module.scaling[name]).T
        index = torch.tensor([i + 1 for i in present], device=weight.device)
        return a_t, b_t, index

    def _add_products(
        self, x: torch.Tensor, output: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor, index: torch.Tensor
    ) -> torch.Tensor:
        """output[expert rows] += s_i B_i A_i x[expert rows], in place; x (N, ..., in), output (N, ..., out)."""
        n = self.n_components
        xs = x.reshape(n, -1, x.shape[-1])  # (k+1, B·T, in)
        contiguous = index.shape[0] == n - 1  # every expert adapts this module: rows 1..k
        xe = xs[1:] if contiguous else xs.index_select(0, index)  # (p, B·T, in)
        delta = torch.bmm(torch.bmm(xe.to(a_t.dtype), a_t), b_t)  # (p, B·T, out)
        out = output.view(n, -1, output.shape[-1])  # (k+1, B·T, out)
        if contiguous:
            out[1:] += delta.to(out.dtype)
        else:
            out.index_add_(0, index, delta.to(out.dtype))
        return output

    def _hook(
        self, a_t: torch.Tensor, b_t: torch.Tensor, index: torch.Tensor
    ) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor], torch.Tensor]:
        def add_lora(module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            return self._add_products(args[0], output, a_t, b_t, index) if self._on else output

        return add_lora

    def _linear_forward(
        self, module: torch.nn.Linear, factors: Factors | None
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """Replacement forward for an nn.Linear of the shared base.

        Outside `active()` it is the plain `F.linear`. Inside, a decoding step has few rows
        ((k+1)·B); on CPU, `W @ xᵀ` reaches the BLAS's matrix-vector-like kernel, which for a few
        rows is faster than `F.linear`'s `x @ Wᵀ` (benchmarks/README.md has the measurements).
        """

        def forward(x: torch.Tensor) -> torch.Tensor:
            if not self._on:
                return F.linear(x, module.weight, module.bias)
            rows = x.reshape(-1, x.shape[-1])  # (N, in)
            if rows.shape[0] <= _FEW_ROWS and rows.device.type == "cpu":
                output = torch.mm(module.weight, rows.T).T.contiguous()  # (N, out)
                if module.bias is not None:
                    output = output + module.bias
            else:
                output = F.linear(rows, module.weight, module.bias)  # (N, out)
            if factors is not None:
                output = self._add_products(rows, output, *factors)
            return output.view(*x.shape[:-1], output.shape[-1])

        return forward

    def close(self) -> None:
        """Remove the hooks and give every patched module its previous forward back; idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for module, previous in self._patched:
            if previous is None:
                del module.__dict__["forward"]  # the class's forward again
            else:
                module.__dict__["forward"] = previous
        self._patched = []

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        self._on = True
        try:
            yield
        finally:
            self._on = False


def _weight(layer: torch.nn.Module) -> torch.Tensor:
    """The weight of a LoRA factor (an nn.Linear; `Module.__getattr__` is typed as Tensor | Module)."""
    return cast(torch.Tensor, layer.weight)
