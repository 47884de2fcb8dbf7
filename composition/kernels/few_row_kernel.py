"""The two kernels of a linear over few rows on a CPU, F.linear's x @ Wᵀ and W @ xᵀ, and `FewRowKernel`'s choice.

A decoding step of a composition runs its linears over few rows: (k+1)·B with LoRA experts on one base,
K+1 per row when speculative decoding verifies K drafted tokens, B·T in a short prompt. With the weights
streaming from memory, as they do in a model at a decoding step, the two kernels cost very different
amounts, and which one wins depends on the CPU and its BLAS (benchmarks/README.md, "The few-row kernel"):
on one AVX-512 CPU x @ Wᵀ was the faster up to 8 rows and W @ xᵀ from 9 to 48; on an AVX2 CPU x @ Wᵀ
over 3 rows took 3.5 times its 1-row time for SmolLM2's output layer, and W @ xᵀ 1.1 times.

So `FewRowKernel` chooses for each row count in `TUNED_ROWS` by timing passes with each (`FewRowLinears` of
few_row_linear.py runs them); x @ Wᵀ is oneDNN's product where it applies (`x_wt`). Both kernels compute the
same product; only the order of their float sums differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mergecompose.composition.kernels.stopwatch import Stopwatch

# A CPU pass over this many rows computes its linears with the kernel `FewRowKernel` chose for it by timing;
# outside it, with F.linear's x @ Wᵀ.
TUNED_ROWS = range(2, 65)


class FewRowKernel:
    """Which kernel computes a linear over few rows on this CPU: F.linear's x @ Wᵀ or W @ xᵀ, chosen by timing.

    For each row count the first `2 · trials` passes alternate the two, timing each pass's linears, and
    later passes take the one with the smaller best time (module docstring)."""

    KERNELS = ("x_wt", "w_xt")
    # Trial passes recorded in this process, by every instance: a loop that times its own rounds (speculative
    # decoding's adaptive K) leaves a round with a trial in it untimed.
    trial_passes = 0

    def __init__(self, trials: int = 2, stopwatch: Stopwatch | None = None) -> None:
        self.trials = trials
        self.stopwatch = Stopwatch() if stopwatch is None else stopwatch  # times each linear of a trial pass
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


def dense_product(kernel: str, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows Wᵀ (+ b), (N, out), by `kernel`: "x_wt" (`x_wt`) or "w_xt" (W @ xᵀ, transposed back)."""
    if kernel == "w_xt":
        output = torch.mm(weight, rows.T).T.contiguous()
        return output if bias is None else output + bias
    return x_wt(rows, weight, bias)


def x_wt(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ Wᵀ (+ b): oneDNN's product with the dense weight where it applies (float32 on a CPU, no gradient, no
    autocast), which ran SmolLM2's output layer over 1 to 24 rows in about half F.linear's time on the AVX2 CPU;
    F.linear elsewhere."""
    if (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and x.device.type == "cpu"
        and type(weight.data) is torch.Tensor
        and weight.layout == torch.strided
        and torch.backends.mkldnn.is_available()
        and not torch.is_autocast_enabled("cpu")
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and not (bias is not None and torch.is_grad_enabled() and bias.requires_grad)
    ):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
