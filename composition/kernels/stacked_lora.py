"""All LoRA experts on one base, their products computed with one batched matmul per module.

peft's mixed-adapter batch (`adapter_names=[...]`) gathers each adapter's rows with Python index
lists and runs two small matmuls per adapter per module, and its forward hooks walk every module
on every call. Here the batch is laid out component-major — rows `[base | expert_1 | … | expert_k]`,
B rows each — so each expert's rows are a contiguous slice, and for every targeted linear layer

    y = W x                                  (all (k+1)·B rows, the base weight read once)
    y[expert i rows] += s_i · B_i A_i x      (i = 1..k)

The products are two `bmm` over the stacked experts when the expert rows are many (a prompt). At a
decoding step they are few, and the time goes to the calls, not to the arithmetic: there all experts'
factors are laid side by side, A = [A_1 | … | A_k] (in, k·r) and B = [B_1; …; B_k] (k·r, out), and

    y += ((x A) ⊙ M) B      (M keeps, in the rows of expert i, its r columns; in the base's rows, none)

which is two plain matrix products and one product with a 0/1 mask, whatever k is; the base's rows add
exactly zero. Siblings that read one input (q, k, v) share the product x A of all their columns, and each
one multiplies its own columns of it (a strided view, no copy) by its own B in one `addmm_`. Where the base's
weights are packed (kernels/few_row_linear.py), A is packed with them as extra rows, so x A comes out of the base's own
product, with no call of its own.

The factors come from the adapters that peft loaded; the LoRA layers are then unloaded
(`PeftModel.unload`, no merge) so the base model is plain again, and the replaced forwards of the base
linears (`FewRowLinears`, kernels/few_row_linear.py) add the stacked products while `active()` is on. `close()` removes
the hooks and gives every module its own forward back.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from peft.tuners.lora.layer import Linear as LoraLinear

from mergecompose.composition.kernels.few_row_kernel import FewRowKernel
from mergecompose.composition.kernels.few_row_linear import FewRowLinears
from mergecompose.composition.kernels.packed_weights import reads_same, same_input_siblings, version_of
from mergecompose.composition.kernels.stopwatch import Stopwatch

# Up to this many expert rows, the LoRA products take the side-by-side path (module docstring).
_FEW_EXPERT_ROWS = 64


class _Factors:
    """One module's stacked factors, scaling folded into B, ranks zero-padded to r_max.

    `a_side` (in, p·r_max) = [A_1 | … | A_p] and `b_side` (p·r_max, out) = [B_1; …; B_p] are stored;
    `a_t` (p, in, r_max) and `b_t` (p, r_max, out) are views of them for the batched products. `index`
    holds the component of each of the p experts present (1..k); `complete` is True when all k are."""

    def __init__(self, a_side: torch.Tensor, b_side: torch.Tensor, index: torch.Tensor, n_experts: int) -> None:
        p = index.shape[0]
        self.a_side, self.b_side, self.index = a_side, b_side, index
        self.rank = a_side.shape[1] // p
        self.a_t = a_side.view(a_side.shape[0], p, self.rank).permute(1, 0, 2)
        self.b_t = b_side.view(p, self.rank, b_side.shape[1])
        self.complete = p == n_experts
        self.group: _SharedInput | None = None
        self.columns = slice(0, a_side.shape[1])  # its columns of `group.a_side`


class _SharedInput:
    """Siblings that read one input: their `a_side` factors side by side in one (in, Σ p·r_m) matrix.

    The first of them to run in a pass computes `(x A) ⊙ M` for all; the others use it if they are given
    the same input unchanged (`reads`), else compute their own. Each member multiplies its own `columns` of
    the product by its own `b_side`: no zero-padded copy of B over the siblings' columns is stored, or read
    at every step for nothing (the same speed as the padded copy in benchmarks/README.md, less memory)."""

    def __init__(self, members: list[_Factors]) -> None:
        self.a_side = torch.cat([member.a_side for member in members], dim=1)
        start = 0
        for member in members:
            width = member.a_side.shape[1]
            member.columns = slice(start, start + width)
            member.a_side = self.a_side[:, start : start + width]  # a view: the factors are stored once
            member.a_t = member.a_side.view(member.a_side.shape[0], -1, member.rank).permute(1, 0, 2)
            member.group = self
            start += width
        self.members = members
        self.x: torch.Tensor | None = None
        self.version: int | None = None  # None: not known (no input yet, or an inference tensor)
        self.hidden: torch.Tensor | None = None

    def reads(self, x: torch.Tensor) -> bool:
        """True if `x` is the input the product was computed from, unchanged (`packed_weights.reads_same`): an inference
        tensor never is, so each sibling then computes its own product."""
        return reads_same(self.x, self.version, x)

    def clear(self) -> None:
        self.x, self.hidden = None, None


# A_t (p, in, r_max), B_t (p, r_max, out): what `StackedLoRA.factors` gives for each module.
Factors = tuple[torch.Tensor, torch.Tensor]


class StackedLoRAUnsupported(ValueError):
    """The adapters use a feature that the stacked path does not implement (DoRA, embeddings...)."""


class StackedLoRA:
    """Hooks that add k experts' LoRA products to their rows of a component-major batch.

    Args:
        peft_model: a PeftModel holding the adapters named in `adapter_names` (consumed: its LoRA
            layers are unloaded and the plain base model is kept in `self.model`).
        adapter_names: the experts, in component order 1..k.
        pack: hold the base's weights in oneDNN's packed layout (True), dense (False), or whichever the base's
            linears run faster over a decoding step's k+1 rows on this machine, timed at load (None, default;
            `self.linears.packing` says what was chosen).
        stopwatch: what times the trials (`kernels/stopwatch.py`); default the clock.
    """

    def __init__(
        self,
        peft_model: Any,
        adapter_names: Sequence[str],
        pack: bool | None = None,
        stopwatch: Stopwatch | None = None,
    ) -> None:
        self.adapter_names = list(adapter_names)
        self.n_components = len(self.adapter_names) + 1
        self._on = False
        stacked: dict[str, _Factors] = {}
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
        self._groups = _same_input_groups(stacked)
        # After grouping: a group's members are views of its matrices, and the ungrouped copies are freed.
        self.factors: dict[str, Factors] = {path: (f.a_t, f.b_t) for path, f in stacked.items()}
        self._masks: dict[tuple[int, tuple[int, ...], int], torch.Tensor] = {}
        self.model = peft_model.unload()  # the base model with its original layers, unmerged
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        linears = []
        extra_rows: dict[torch.nn.Module, torch.Tensor] = {}  # the A factors, packed with the base weights
        for path, module in self.model.named_modules():
            if isinstance(module, torch.nn.Linear):
                factors = stacked.get(path)
                addition = None if factors is None else functools.partial(self._add_products, factors=factors)
                linears.append((module, addition))
                if factors is not None and factors.complete:
                    if factors.group is None:
                        extra_rows[module] = factors.a_side.T
                    elif factors is factors.group.members[0]:
                        extra_rows[module] = factors.group.a_side.T
            elif path in stacked:  # e.g. GPT-2's Conv1D: keep its forward, add the products after it
                self._handles.append(module.register_forward_hook(self._hook(stacked[path])))
        # The shared base's linears run over (k+1)·B rows at a decoding step: their weights packed where oneDNN
        # can and it is faster here (the base's own bytes, reordered in place until `close()`), else the few-row
        # kernel (few_row_kernel.py), each chosen by timing.
        self.linears = FewRowLinears(
            linears,
            FewRowKernel(stopwatch=stopwatch),
            pack_model=self.model,
            pack_rows=self.n_components,
            extra_rows=extra_rows,
            pack=pack,
            stopwatch=stopwatch,
        )

    @property
    def few_rows(self) -> FewRowKernel:
        """The few-row kernel's choice for the shared base's linears."""
        return self.linears.kernel

    @few_rows.setter
    def few_rows(self, kernel: FewRowKernel) -> None:
        self.linears.kernel = kernel

    def _stack(self, module: LoraLinear, names: list[str], present: list[int]) -> _Factors:
        """The experts' factors of `module`, side by side (`_Factors`)."""
        a = [_weight(module.lora_A[name]) for name in names]  # (r_j, in) each
        b = [_weight(module.lora_B[name]) for name in names]  # (out, r_j) each
        ranks = [weight.shape[0] for weight in a]
        in_features, out_features = a[0].shape[1], b[0].shape[0]
        weight = a[0]
        p, r_max = len(names), max(ranks)
        a_side = torch.zeros(in_features, p * r_max, dtype=weight.dtype, device=weight.device)
        b_side = torch.zeros(p * r_max, out_features, dtype=weight.dtype, device=weight.device)
        a_t = a_side.view(in_features, p, r_max).permute(1, 0, 2)  # (p, in, r_max), a view
        b_t = b_side.view(p, r_max, out_features)
        for j, name in enumerate(names):
            rank = ranks[j]
            a_t[j, :, :rank] = a[j].detach().T
            b_t[j, :rank, :] = (b[j].detach() * module.scaling[name]).T
        index = torch.tensor([i + 1 for i in present], device=weight.device)
        return _Factors(a_side, b_side, index, self.n_components - 1)

    def _add_products(
        self, x: torch.Tensor, output: torch.Tensor, extra: torch.Tensor | None = None, *, factors: _Factors
    ) -> torch.Tensor:
        """output[expert rows] += s_i B_i A_i x[expert rows], in place; x (N, in), output (N, out), N = (k+1)·B·T.

        `extra`: x A of this module's (or its group's) side-by-side factors, where the packed base product computed
        it with the weights (kernels/few_row_linear.py, `extra_rows`); None: computed here."""
        n = self.n_components
        rows = x.shape[0] // n  # B·T, the rows of one component
        if factors.complete and (n - 1) * rows <= _FEW_EXPERT_ROWS and x.dtype == factors.a_side.dtype == output.dtype:
            # The base rows of the product are zeros: they add exactly 0 to the base's outputs.
            hidden = self._side_by_side(x, rows, factors, extra)  # (N, Σ p·r): a group's holds the siblings' too
            output.addmm_(hidden if factors.group is None else hidden[:, factors.columns], factors.b_side)
            return output
        xs = x.view(n, rows, x.shape[-1])  # (k+1, B·T, in)
        xe = xs[1:] if factors.complete else xs.index_select(0, factors.index)  # (p, B·T, in)
        delta = torch.bmm(torch.bmm(xe.to(factors.a_t.dtype), factors.a_t), factors.b_t)  # (p, B·T, out)
        out = output.view(n, rows, output.shape[-1])  # (k+1, B·T, out)
        if factors.complete:
            out[1:] += delta.to(out.dtype)
        else:
            out.index_add_(0, factors.index, delta.to(out.dtype))
        return output

    def _side_by_side(
        self, x: torch.Tensor, rows: int, factors: _Factors, extra: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(x A) ⊙ M, (N, Σ p·r): each expert's rows keep its own r columns, the base's rows none (module docstring).

        In a group, the product of all siblings' columns (each member reads its own `columns` of it). `extra`, if
        given, is x A already computed (`_add_products`), and is masked in place."""
        group = factors.group
        if group is None:
            hidden = torch.mm(x, factors.a_side) if extra is None else extra
            return hidden.mul_(self._mask(rows, (factors.rank,), factors.index.shape[0], hidden))
        if group.hidden is None or not group.reads(x):
            hidden = torch.mm(x, group.a_side) if extra is None else extra
            ranks = tuple(member.rank for member in group.members)
            group.hidden = hidden.mul_(self._mask(rows, ranks, factors.index.shape[0], hidden))
            group.x, group.version = x, version_of(x)
        return group.hidden

    def _mask(self, rows: int, ranks: tuple[int, ...], p: int, like: torch.Tensor) -> torch.Tensor:
        """((p+1)·rows, p·Σ ranks) 0/1: the base's rows keep nothing; for each module of rank r, expert i's rows
        keep that module's r columns of i."""
        key = (rows, ranks, p)
        mask = self._masks.get(key)
        if mask is None or mask.dtype != like.dtype or mask.device != like.device:
            blocks = [
                torch.block_diag(*[torch.ones(rows, rank, dtype=like.dtype, device=like.device)] * p) for rank in ranks
            ]
            experts = torch.cat(blocks, dim=1)  # (p·rows, p·Σ ranks)
            mask = self._masks[key] = torch.cat([torch.zeros_like(experts[:rows]), experts])
        return mask

    def _hook(
        self, factors: _Factors
    ) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor], torch.Tensor]:
        def add_lora(module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            if not self._on:
                return output
            x = args[0].reshape(-1, args[0].shape[-1])
            return self._add_products(x, output.view(-1, output.shape[-1]), factors=factors).view(output.shape)

        return add_lora

    def close(self) -> None:
        """Remove the hooks and give every patched module its previous forward back; idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.linears.close()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """One pass of the component-major batch: the LoRA products added, the few-row kernel on."""
        self._on = True
        try:
            with self.linears.active():
                yield
        finally:
            self._on = False
            for group in self._groups:
                group.clear()  # no input or product is kept from one pass to the next


def _same_input_groups(stacked: dict[str, _Factors]) -> list[_SharedInput]:
    """Siblings named in `SAME_INPUT` with all experts present and one dtype, device and input size."""
    groups = []
    for members in same_input_siblings((path, factors) for path, factors in stacked.items() if factors.complete):
        first = members[0].a_side
        if all(
            f.a_side.shape[0] == first.shape[0] and f.a_side.dtype == first.dtype and f.a_side.device == first.device
            for f in members
        ):
            groups.append(_SharedInput(members))
    return groups


def _weight(layer: torch.nn.Module) -> torch.Tensor:
    """The weight of a LoRA factor (an nn.Linear; `Module.__getattr__` is typed as Tensor | Module)."""
    return cast(torch.Tensor, layer.weight)
