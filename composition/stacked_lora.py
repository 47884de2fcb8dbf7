"""All LoRA experts on one base, their products computed with one batched matmul per module.

peft's mixed-adapter batch (`adapter_names=[...]`) gathers each adapter's rows with Python index
lists and runs two small matmuls per adapter per module, and its forward hooks walk every module
on every call. Here the batch is laid out component-major — rows `[base | expert_1 | … | expert_k]`,
B rows each — so each expert's rows are a contiguous slice, and for every targeted linear layer

    y = W x                                  (all (k+1)·B rows, the base weight read once)
    y[expert i rows] += s_i · B_i A_i x      (i = 1..k, as two `bmm` over the stacked experts)

The factors come from the adapters that peft loaded; the LoRA layers are then unloaded
(`PeftModel.unload`, no merge) so the base model is plain again, and forward hooks on the base
linears add the stacked products while `active()` is on.
"""

from __future__ import annotations

import contextlib

import torch
from peft.tuners.lora.layer import Linear as LoraLinear


class StackedLoRAUnsupported(ValueError):
    """The adapters use a feature that the stacked path does not implement (DoRA, embeddings...)."""


class StackedLoRA:
    """Hooks that add k experts' LoRA products to their rows of a component-major batch.

    Args:
        peft_model: a PeftModel holding the adapters named in `adapter_names` (consumed: its LoRA
            layers are unloaded and the plain base model is kept in `self.model`).
        adapter_names: the experts, in component order 1..k.
    """

    def __init__(self, peft_model, adapter_names):
        self.adapter_names = list(adapter_names)
        self.n_components = len(self.adapter_names) + 1
        self._on = False
        stacked = {}
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
        modules = dict(self.model.named_modules())
        self._handles = [modules[path].register_forward_hook(self._hook(*factors)) for path, factors in stacked.items()]

    @staticmethod
    def _stack(module, names, present):
        """A_t: (p, in, r_max), B_t: (p, r_max, out) with the scaling folded into B; zero-padded ranks."""
        ranks = [module.lora_A[name].weight.shape[0] for name in names]
        in_features = module.lora_A[names[0]].weight.shape[1]
        out_features = module.lora_B[names[0]].weight.shape[0]
        weight = module.lora_A[names[0]].weight
        a_t = torch.zeros(len(names), in_features, max(ranks), dtype=weight.dtype, device=weight.device)
        b_t = torch.zeros(len(names), max(ranks), out_features, dtype=weight.dtype, device=weight.device)
        for j, name in enumerate(names):
            rank = ranks[j]
            a_t[j, :, :rank] = module.lora_A[name].weight.detach().T
            b_t[j, :rank, :] = (module.lora_B[name].weight.detach() * module.scaling[name]).T
        index = torch.tensor([i + 1 for i in present], device=weight.device)
        return a_t, b_t, index

    def _hook(self, a_t, b_t, index):
        n = self.n_components
        contiguous = index.tolist() == list(range(1, n))

        def add_lora(module, args, output):
            if not self._on:
                return output
            x = args[0]
            xs = x.reshape(n, -1, x.shape[-1])  # (k+1, B·T, in)
            xe = xs[1:] if contiguous else xs.index_select(0, index)  # (p, B·T, in)
            delta = torch.bmm(torch.bmm(xe.to(a_t.dtype), a_t), b_t)  # (p, B·T, out)
            out = output.view(n, -1, output.shape[-1])  # (k+1, B·T, out)
            if contiguous:
                out[1:] += delta.to(out.dtype)
            else:
                out.index_add_(0, index, delta.to(out.dtype))
            return output

        return add_lora

    @contextlib.contextmanager
    def active(self):
        self._on = True
        try:
            yield
        finally:
            self._on = False
