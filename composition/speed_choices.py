"""What a `ComposedLM` chooses by timing on this machine, kept across its calls, and the report of every such choice.

Whether the shared base's weights are packed is timed at load, and which few-row kernel serves each row count on the
first passes at that count (`FewRowLinears`, kernels/few_row_linear.py, held by the backend). Whether `generate` mixes
the components' last hidden states before one output-layer pass (kernels/mixed_head.py) is timed here, on the first
call at each batch size, and the drafts' passes keep one few-row kernel's choice across calls. `SpeedChoices.report`
gathers them all for `ComposedLM.speed_choices`; a test gives a fake `Stopwatch` and sees the option it prefers chosen.
"""

from __future__ import annotations

from collections.abc import Sequence

from mergecompose.composition.backend import Backend
from mergecompose.composition.kernels.few_row_kernel import FewRowKernel
from mergecompose.composition.kernels.mixed_head import can_mix, measure_mixing
from mergecompose.composition.kernels.stopwatch import Choice, Stopwatch


class SpeedChoices:
    """The choices of one composition made by timing, kept until it closes (module docstring)."""

    def __init__(self) -> None:
        self.draft_kernel = FewRowKernel()  # the few-row kernel's choice for the drafts' passes
        self.mixing: dict[int, Choice] = {}  # batch size -> whether to mix before the head, what the timing chose
        self._can_mix: bool | None = None  # whether the backend allows mixing at all, checked once

    def mixes_before_head(
        self,
        backend: Backend,
        setting: bool | None,
        batch: int,
        weights: Sequence[float] | None,
        num_experts: int,
        stopwatch: Stopwatch,
    ) -> bool:
        """Whether `generate` mixes the components' last hidden states before one output layer pass: `setting`
        (`ComposedLM.mix_before_head`) not False, a backend that allows it (checked once), and with `setting` None,
        mixing timed faster by `stopwatch` at `batch` rows (timed once per batch size)."""
        if setting is False:
            return False
        if self._can_mix is None:
            self._can_mix = can_mix(backend)
        if not self._can_mix or setting:
            return self._can_mix
        if batch not in self.mixing:
            head = backend.base_model.get_output_embeddings()  # a Linear: `can_mix` checked it
            self.mixing[batch] = measure_mixing(head, weights, num_experts, batch, stopwatch)
        return self.mixing[batch].chosen == "mixed"

    def report(self, backend: Backend) -> dict[str, object]:
        """What the timings on this machine chose so far, with each option's best time in ms: whether `backend`'s
        shared base weights are packed, its few-row kernel by row count, and mixing before the output layer by batch
        size. Choices fixed by an argument or not made are left out."""
        choices: dict[str, object] = {}
        linears = getattr(backend, "linears", None)
        stacked = getattr(backend, "stacked", None)
        if stacked is not None:
            linears = stacked.linears
        if linears is not None:
            if linears.packing is not None:
                choices["packed weights"] = linears.packing.summary()
            if linears.kernel.chosen:
                choices["few-row kernel"] = dict(linears.kernel.chosen)
        if self.mixing:
            choices["mixed head"] = {batch: choice.summary() for batch, choice in self.mixing.items()}
        return choices
