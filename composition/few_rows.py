"""Linear layers over few rows on a CPU: F.linear's x @ Wᵀ or W @ xᵀ, whichever this machine runs faster.

A decoding step of a composition runs its linears over few rows: (k+1)·B with LoRA experts on one base,
K+1 per row when speculative decoding verifies K drafted tokens, B·T in a short prompt. With the weights
streaming from memory, as they do in a model at a decoding step, the two kernels cost very different
amounts, and which one wins depends on the CPU and its BLAS (benchmarks/README.md, "The few-row kernel"):
on one AVX-512 CPU x @ Wᵀ was the faster up to 8 rows and W @ xᵀ from 9 to 48; on an AVX2 CPU x @ Wᵀ
over 3 rows took 3.5 times its 1-row time for SmolLM2's output layer, and W @ xᵀ 1.1 times.

`FewRowLinears` replaces the forward of a model's `nn.Linear` modules by one that, inside `active()`,
computes a pass over a row count in `TUNED_ROWS` with the kernel `FewRowKernel` chose for it, and
`close()` gives every module its own forward back. Both kernels compute the same product; only the order
of their float sums differs.
"""

from __future__ import annotations

import contextlib
import time
import types
from collections.abc import Callable, Iterable, Iterator
from typing import cast

import torch
import torch.nn.functional as F

# A CPU pass over this many rows computes its linears with the kernel `FewRowKernel` chose for it by timing;
# outside it, with F.linear's x @ Wᵀ.
TUNED_ROWS = range(2, 65)

# What is added to a linear's output after the product, e.g. LoRA products: (x (N, in), output (N, out)) -> output.
Addition = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class FewRowKernel:
    """Which kernel computes a linear over few rows on this CPU: F.linear's x @ Wᵀ or W @ xᵀ, chosen by timing.

    For each row count the first `2 · trials` passes alternate the two, timing each pass's linears, and
    later passes take the one with the smaller best time (module docstring)."""

    KERNELS = ("x_wt", "w_xt")
    # Trial passes recorded in this process, by every instance: a loop that times its own rounds (speculative
    # decoding's adaptive K) leaves a round with a trial in it untimed.
    trial_passes = 0

    def __init__(self, trials: int = 2) -> None:
        self.trials = trials
        self.seconds: dict[int, dict[str, list[float]]] = {}  # rows -> kernel -> timed passes
        self.chosen: dict[int, str] = {}

    def kernel(self, rows: int) -> str:
        """The kernel of the next pass over `rows` rows (a trial while the choice is not made)."""
        if rows in self.chosen:
            return self.chosen[rows]
        timed = self.seconds.get(rows, {})
        counts = [len(timed.get(kernel, [])) for kernel in self.KERNELS]
        return self.KERNELS[0] if counts[0] <= counts[1] else self.KERNELS[1]

    def timing(self, rows: int) -> bool:
        """True while passes over `rows` rows are trials, to be timed and `record`ed."""
        return rows not in self.chosen

    def record(self, rows: int, kernel: str, seconds: float) -> None:
        """A trial pass's time; after `trials` passes of each kernel, the one with the smaller best time is chosen."""
        timed = self.seconds.setdefault(rows, {name: [] for name in self.KERNELS})
        timed[kernel].append(seconds)
        FewRowKernel.trial_passes += 1
        if all(len(times) >= self.trials for times in timed.values()):
            self.chosen[rows] = min(self.KERNELS, key=lambda name: min(timed[name]))


class FewRowLinears:
    """The forwards of `linears` replaced: F.linear outside `active()`; inside, the few-row kernel, then `addition`.

    A pass (one `active()` block) takes its row count from its first linear; a linear over another row
    count in it (an output layer that keeps only the last positions of a prompt) uses x @ Wᵀ. Passes
    that are trials of `kernel` are timed, linear by linear. A module listed twice is patched once.

    Args:
        linears: `(module, addition or None)` pairs.
        kernel: the choice to use and update (shared by the models of one backend); default a new one.
    """

    def __init__(self, linears: Iterable[tuple[torch.nn.Linear, Addition | None]], kernel: FewRowKernel | None = None):
        self.kernel = FewRowKernel() if kernel is None else kernel
        self._on = False
        # The pass under way: its row count, kernel, and whether it is timed; the seconds its linears took.
        self._pass: tuple[int, str, bool] | None = None
        self._pass_seconds = 0.0
        # (module, its instance-level forward before ours or None), for `close()`.
        self._patched: list[tuple[torch.nn.Module, Callable[..., torch.Tensor] | None]] = []
        seen: set[int] = set()
        for module, addition in linears:
            if id(module) in seen:
                continue
            seen.add(id(module))
            self._patched.append((module, module.__dict__.get("forward")))
            # An instance attribute, bound to the module: the class's forward is left alone, `close()` deletes
            # ours, and a deep copy of the model made meanwhile computes with its own weights.
            module.__dict__["forward"] = types.MethodType(self._forward(addition), module)

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
            if not self._on:
                return F.linear(x, weight, bias)
            rows = x.reshape(-1, x.shape[-1])  # (N, in)
            count = rows.shape[0]
            current = self._pass
            if current is None:  # the pass's first linear sets its row count and kernel
                tuned = count in TUNED_ROWS and rows.device.type == "cpu"
                kernel = self.kernel.kernel(count) if tuned else "x_wt"
                current = self._pass = (count, kernel, tuned and self.kernel.timing(count))
            kernel, timing = "x_wt", False
            if current[0] == count:  # (an output layer over fewer rows than a prompt pass keeps x @ Wᵀ)
                _, kernel, timing = current
            started = time.perf_counter() if timing else 0.0
            if kernel == "w_xt":
                output = torch.mm(weight, rows.T).T.contiguous()  # (N, out)
                if bias is not None:
                    output = output + bias
            else:
                output = F.linear(rows, weight, bias)  # (N, out)
            if timing:
                self._pass_seconds += time.perf_counter() - started
            if addition is not None:
                output = addition(rows, output)
            return output.view(*x.shape[:-1], output.shape[-1])

        return forward

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """One pass: the replaced forwards use the few-row kernel; a whole trial pass is recorded at the end."""
        self._on = True
        self._pass, self._pass_seconds = None, 0.0
        completed = False
        try:
            yield
            completed = True
        finally:
            self._on = False
            if completed and self._pass is not None and self._pass[2]:
                self.kernel.record(self._pass[0], self._pass[1], self._pass_seconds)
            self._pass = None

    def close(self) -> None:
        """Give every patched module its previous forward back; idempotent."""
        for module, previous in reversed(self._patched):
            if previous is None:
                del module.__dict__["forward"]  # the class's forward again
            else:
                module.__dict__["forward"] = previous
        self._patched = []
