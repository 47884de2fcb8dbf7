"""Linear layers over few rows on a CPU: each pass with the kernel this machine runs faster, weights packed where
that pays.

`FewRowLinears` replaces the forward of a model's `nn.Linear` modules by one that, inside `active()`,
computes a pass over a row count in `TUNED_ROWS` with the kernel `FewRowKernel` chose for it (few_row_kernel.py:
F.linear's x @ Wᵀ or W @ xᵀ), and `close()` gives every module its own forward back.

**Packed weights** (packed_weights.py). Better than either kernel, where torch has oneDNN: a float32 weight
reordered once into oneDNN's blocked layout for a few rows. On the AVX2
CPU of benchmarks/README.md, SmolLM2's 210 decoder linears took 47 ms over 3 rows this way against 61 ms
for W @ xᵀ and 52 ms for F.linear over 1 row, and less at every row count up to 192; on other CPUs packing has
cost more than it saved (benchmarks/README.md). So with `pack_model`, `FewRowLinears` times the linears' products
over `pack_rows` rows at load, dense with each kernel and then packed, all in order as a pass streams them from
memory (`pack` None, `packing` records the choice), and keeps the faster: the best of a few passes each, dense ones
first (not interleaved with packed ones: both layouts at once would double the weights' memory). `pack` True or
False fixes it. Packing is in place, siblings that read one input as one matrix (packed_weights.py); `close()` puts
the dense weight back, bit for bit (a module that loaded a state dict meanwhile keeps what it loaded). The output
layer, a weight that another module also holds (tied embeddings), or one that is not a float32 CPU matrix stays
dense; a forward that needs gradients, runs under autocast or gets another dtype multiplies by the dense weight,
unpacked for that call.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterable, Iterator
from typing import cast

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from mergecompose.composition.kernels.few_row_kernel import TUNED_ROWS, FewRowKernel, dense_product
from mergecompose.composition.kernels.packed_weights import (
    PACKED,
    Packed,
    PackedGroup,
    PackedSibling,
    can_pack,
    hold_packed,
    same_input_siblings,
    trim_heap,
)
from mergecompose.composition.kernels.stopwatch import Choice, Stopwatch, best, timed_runs

# What is added to a linear's output after the product, e.g. LoRA products: (x (N, in), output (N, out), extra) ->
# output; `extra` is x Eᵀ (N, e) for the module's extra rows E (`FewRowLinears`), or None where it was not computed.
Addition = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class FewRowLinears:
    """The forwards of `linears` replaced: F.linear outside `active()`; inside, the few-row kernel, then `addition`.

    A pass (one `active()` block) takes its row count from its first linear; a linear over another row
    count in it (an output layer that keeps only the last positions of a prompt) uses x @ Wᵀ. Passes
    that are trials of `kernel` are timed, linear by linear. A module listed twice is patched once.

    Args:
        linears: `(module, addition or None)` pairs.
        kernel: the choice to use and update (shared by the models of one backend); default a new one.
        pack_model: the model that holds `linears`: pack their weights (module docstring), for passes of about
            `pack_rows` rows; None: leave them dense.
        extra_rows: by module, rows E (e, in) packed with its weight (`PackedGroup`): its addition is given x Eᵀ
            when the packed product computed it, None otherwise.
        pack: with `pack_model`: None (default) packs if timing at load finds it faster (module docstring; `packing`
            says what was chosen), True packs, False leaves the weights dense.
        stopwatch: what times the packing trial (kernels/stopwatch.py); default the clock.
        trial_repeats: timed passes of each option in the packing trial.
    """

    def __init__(
        self,
        linears: Iterable[tuple[torch.nn.Linear, Addition | None]],
        kernel: FewRowKernel | None = None,
        *,
        pack_model: torch.nn.Module | None = None,
        pack_rows: int = 1,
        extra_rows: dict[torch.nn.Module, torch.Tensor] | None = None,
        pack: bool | None = None,
        stopwatch: Stopwatch | None = None,
        trial_repeats: int = 5,
    ):
        self.kernel = FewRowKernel() if kernel is None else kernel
        # What the measurement at load chose between packed and dense weights (`pack` None), else None.
        self.packing: Choice | None = None
        self._on = False
        # The pass under way: its row count, kernel, and whether it is timed; the seconds its linears took.
        self._pass: tuple[int, str, bool] | None = None
        self._pass_seconds = 0.0
        self._pass_timed = 0  # the linears timed in it
        # (module, its instance-level forward before ours or None), for `close()`.
        self._patched: list[tuple[torch.nn.Module, Callable[..., torch.Tensor] | None]] = []
        # (module, its weight parameter, the state-dict hooks' handles) of every packed module, for `close()`.
        self._packed: list[tuple[torch.nn.Module, torch.nn.Parameter, list[torch.utils.hooks.RemovableHandle]]] = []
        self._groups: list[PackedGroup] = []  # siblings packed as one, whose kept product a pass's end clears
        held = _weights_held_once(pack_model) if pack_model is not None else set()
        if isinstance(pack_model, PreTrainedModel) and isinstance(pack_model.get_output_embeddings(), torch.nn.Module):
            # The output layer stays dense: its weight's shape is the vocabulary that callers read, and over the
            # few rows it runs on (the last position, or the mixed rows) oneDNN's dense product is as fast.
            held.discard(id(pack_model.get_output_embeddings().weight))
        seen: set[int] = set()
        for module, addition in linears:
            if id(module) in seen:
                continue
            seen.add(id(module))
            self._patched.append((module, module.__dict__.get("forward")))
            # An instance attribute, bound to the module: the class's forward is left alone, `close()` deletes
            # ours, and a deep copy of the model made meanwhile computes with its own weights.
            module.__dict__["forward"] = types.MethodType(self._forward(addition), module)
        if pack_model is not None and pack is not False:
            packable = [
                module
                for module, _ in self._patched
                if module._parameters["weight"] is not None
                and id(module._parameters["weight"]) in held
                and can_pack(cast(torch.Tensor, module._parameters["weight"]))
            ]
            extras = extra_rows or {}
            groups = _sibling_groups(pack_model, packable)
            grouped = {id(module) for members in groups for module in members}
            units = [*groups, *([module] for module in packable if id(module) not in grouped)]
            measure = pack is None and bool(packable)
            stopwatch = Stopwatch() if stopwatch is None else stopwatch
            inputs = _trial_inputs(units, pack_rows) if measure else []
            dense = _dense_trials(units, extras, inputs, stopwatch, trial_repeats) if measure else {}
            for members in groups:
                self._pack_siblings(members, pack_rows, extras)
            for alone in packable:
                if PACKED in alone.__dict__:
                    continue
                if alone in extras and alone._parameters.get("bias") is None:
                    self._pack_siblings([alone], pack_rows, extras)
                else:
                    self._pack(alone, Packed(cast(torch.Tensor, alone._parameters["weight"]).data, pack_rows))
            trim_heap()
            if measure:
                packed = timed_runs({"packed": _packed_pass(units, inputs)}, stopwatch, trial_repeats)
                self.packing = best({**dense, **packed})
                if self.packing.chosen != "packed":
                    self._unpack()
                trim_heap()  # the trials' temporaries, and the packed bytes if they were given back

    def _pack_siblings(
        self, members: list[torch.nn.Module], rows: int, extras: dict[torch.nn.Module, torch.Tensor]
    ) -> None:
        """Pack siblings that read one input as one matrix (`PackedGroup`), with the extra rows of the first member
        that has any (of the same dtype and input size)."""
        weights = [cast(torch.Tensor, module._parameters["weight"]) for module in members]
        sizes, extra = [weight.shape[0] for weight in weights], None
        blocks = [weight.detach() for weight in weights]
        for index, module in enumerate(members):
            rows_e = extras.get(module)
            if rows_e is not None and rows_e.dtype == blocks[0].dtype and rows_e.shape[1:] == blocks[0].shape[1:]:
                blocks.append(rows_e.detach())
                extra = (index, rows_e.shape[0])
                break
        group = PackedGroup(torch.cat(blocks), rows, sizes, extra)
        # No other tensor may hold the weights' storage when `_pack` releases their pages.
        del weights, blocks
        self._groups.append(group)
        for index, module in enumerate(members):
            self._pack(module, PackedSibling(group, index))

    def _pack(self, module: torch.nn.Module, packed: Packed | PackedSibling) -> None:
        weight = cast(torch.nn.Parameter, module._parameters["weight"])
        self._packed.append((module, weight, hold_packed(module, packed)))

    @classmethod
    def of_models(cls, models: Iterable[torch.nn.Module], kernel: FewRowKernel | None = None) -> FewRowLinears:
        """Every plain `nn.Linear` of `models` (subclasses, e.g. quantized layers, keep their own forward)."""
        linears = (
            (module, None)
            for model in models
            for module in model.modules()
            if type(module) is torch.nn.Linear and type(module.weight.data) is torch.Tensor
        )
        return cls(linears, kernel)

    def _forward(self, addition: Addition | None) -> Callable[[torch.nn.Linear, torch.Tensor], torch.Tensor]:
        def forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
            parameters = module._parameters  # what `module.weight` reads, without nn.Module.__getattr__
            weight, bias = cast(torch.Tensor, parameters["weight"]), parameters["bias"]
            packed = module.__dict__.get(PACKED)
            if packed is not None:
                return self._packed_forward(packed, x, weight, bias, addition)
            if not self._on:
                return F.linear(x, weight, bias)
            rows = x.reshape(-1, x.shape[-1])  # (N, in)
            count = rows.shape[0]
            current = self._pass
            if current is None:  # the pass's first linear sets its row count and kernel
                current = self._start_pass(rows)
            kernel, timing = "x_wt", False
            if current[0] == count:  # (an output layer over fewer rows than a prompt pass keeps x @ Wᵀ)
                _, kernel, timing = current
            if timing:
                product = functools.partial(dense_product, kernel, rows, weight, bias)
                output, seconds = self.kernel.stopwatch.measure(kernel, product)
                self._pass_seconds += seconds
                self._pass_timed += 1
            else:
                output = dense_product(kernel, rows, weight, bias)  # (N, out)
            if addition is not None:
                output = addition(rows, output, None)
            return output.view(*x.shape[:-1], output.shape[-1])

        return forward

    def _start_pass(self, rows: torch.Tensor) -> tuple[int, str, bool]:
        """The pass's row count (that of its first linear), its kernel, and whether it is a timed trial."""
        count = rows.shape[0]
        tuned = count in TUNED_ROWS and rows.device.type == "cpu"
        kernel = self.kernel.kernel(count) if tuned else "x_wt"
        self._pass = (count, kernel, tuned and self.kernel.timing(count))
        return self._pass

    def _packed_forward(
        self,
        packed: Packed | PackedSibling,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        addition: Addition | None,
    ) -> torch.Tensor:
        """A packed module's forward, in and outside `active()` (the additions only inside)."""
        rows = x.reshape(-1, x.shape[-1])  # (N, in)
        if self._on and self._pass is None:  # the pass's row count, for the dense linears after it
            self._start_pass(rows)
        needs_dense = (
            x.dtype != torch.float32
            or torch.is_autocast_enabled("cpu")
            or (
                torch.is_grad_enabled()
                and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
            )
        )
        extra = None
        if needs_dense:  # oneDNN's op has no autograd formula and no autocast rule
            output = F.linear(rows, packed.dense(), bias)
        elif isinstance(packed, PackedSibling):  # (siblings are packed only without biases)
            product = packed.group.product(rows, packed.index)
            output = product[:, packed.start : packed.end]
            if packed.extra is not None:
                extra = product[:, packed.extra]
        else:
            output = torch.ops.mkldnn._linear_pointwise(rows, packed.tensor, bias, "none", [], "")
        if self._on and addition is not None:
            output = addition(rows, output, extra)
        return output.view(*x.shape[:-1], output.shape[-1])

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """One pass: the replaced forwards use the few-row kernel; a whole trial pass is recorded at the end."""
        self._on = True
        self._pass, self._pass_seconds, self._pass_timed = None, 0.0, 0
        completed = False
        try:
            yield
            completed = True
        finally:
            self._on = False
            for group in self._groups:
                group.clear()  # no input or product is kept from one pass to the next
            # A trial is recorded if a dense linear was timed in it (packed ones use neither kernel).
            if completed and self._pass is not None and self._pass[2] and self._pass_timed:
                self.kernel.record(self._pass[0], self._pass[1], self._pass_seconds)
            self._pass = None

    @property
    def packed(self) -> bool:
        """True while some of the linears' weights are held packed."""
        return bool(self._packed)

    def _unpack(self) -> None:
        """Every packed module's dense weight back, bit for bit, and its state-dict hooks removed.

        One packed matrix at a time: a group is made dense once for its siblings (packed one after another, so
        adjacent here) and its packed bytes are let go with its last sibling's, so that the two layouts are never
        both held for more than one group (a timing trial that chose dense weights gives the packed ones back)."""
        self._groups = []
        group: PackedGroup | None = None
        group_dense: torch.Tensor | None = None
        for module, weight, handles in reversed(self._packed):
            packed = module.__dict__.pop(PACKED, None)
            if isinstance(packed, PackedSibling):
                if packed.group is not group:
                    group = group_dense = None  # the previous group's packed and dense bytes go first
                    group, group_dense = packed.group, packed.group.dense()
                assert group_dense is not None
                weight.data = group_dense[packed.start : packed.end].clone()
            elif packed is not None:  # (a module that loaded a state dict meanwhile keeps what it loaded)
                weight.data = packed.dense()
            del packed
            for handle in handles:
                handle.remove()
        del group, group_dense
        self._packed = []

    def close(self) -> None:
        """Give every patched module its previous forward and its dense weight back; idempotent."""
        self._unpack()
        for module, previous in reversed(self._patched):
            if previous is None:
                del module.__dict__["forward"]  # the class's forward again
            else:
                module.__dict__["forward"] = previous
        self._patched = []


def _trial_inputs(units: list[list[torch.nn.Module]], rows: int) -> list[torch.Tensor]:
    """A seeded random input of `rows` rows for each unit (siblings read one input), one per input size."""
    generator = torch.Generator().manual_seed(0)
    by_size: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    inputs = []
    for members in units:
        weight = cast(torch.Tensor, members[0]._parameters["weight"])
        key = (weight.shape[1], weight.dtype)
        if key not in by_size:
            by_size[key] = torch.randn(rows, weight.shape[1], generator=generator, dtype=weight.dtype)
        inputs.append(by_size[key])
    return inputs


def _dense_trials(
    units: list[list[torch.nn.Module]],
    extras: dict[torch.nn.Module, torch.Tensor],
    inputs: list[torch.Tensor],
    stopwatch: Stopwatch,
    repeats: int,
) -> dict[str, list[float]]:
    """The seconds of every unit's products with dense weights, by each few-row kernel: what a decoding pass of
    these linears computes unpacked (each member's product, and x Eᵀ of the extra rows by its own `mm`)."""
    work = []
    for members, x in zip(units, inputs):
        for module in members:
            weight = cast(torch.Tensor, module._parameters["weight"]).detach()
            bias = module._parameters.get("bias")
            work.append((x, weight, None if bias is None else bias.detach(), extras.get(module)))

    def run(kernel: str) -> None:
        with torch.no_grad():
            for x, weight, bias, extra in work:
                dense_product(kernel, x, weight, bias)
                if extra is not None:
                    torch.mm(x, extra.T)

    return timed_runs({kernel: functools.partial(run, kernel) for kernel in FewRowKernel.KERNELS}, stopwatch, repeats)


def _packed_pass(units: list[list[torch.nn.Module]], inputs: list[torch.Tensor]) -> Callable[[], None]:
    """A run of every unit's products with its packed weights: one product a group, its extra rows included."""
    work: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    for members, x in zip(units, inputs):
        packed = members[0].__dict__.get(PACKED)
        if isinstance(packed, PackedSibling):
            work.append((x, packed.group.tensor, None))  # (siblings are packed only without biases)
        elif isinstance(packed, Packed):
            bias = members[0]._parameters.get("bias")
            work.append((x, packed.tensor, None if bias is None else bias.detach()))

    def run() -> None:
        with torch.no_grad():
            for x, tensor, bias in work:
                torch.ops.mkldnn._linear_pointwise(x, tensor, bias, "none", [], "")

    return run


def _sibling_groups(model: torch.nn.Module, modules: list[torch.nn.Module]) -> list[list[torch.nn.Module]]:
    """Of `modules`, the siblings named in `SAME_INPUT` under one parent, with one input size and no bias."""
    wanted = {id(module) for module in modules}
    candidates = (
        (path, module)
        for path, module in model.named_modules()
        if id(module) in wanted and module._parameters.get("bias") is None
    )
    return [
        members
        for members in same_input_siblings(candidates)
        if len({cast(torch.Tensor, module._parameters["weight"]).shape[1] for module in members}) == 1
    ]


def _weights_held_once(model: torch.nn.Module) -> set[int]:
    """The ids of `model`'s parameters that only one module holds (a tied embedding and output layer share one)."""
    counts: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        counts[id(parameter)] = counts.get(id(parameter), 0) + 1
    return {key for key, count in counts.items() if count == 1}
