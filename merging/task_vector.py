"""Task vectors τ = θ_ft − θ_base over named tensors (Ilharco et al., 2023, arXiv:2212.04089)."""

from __future__ import annotations

import copy
import math
import numbers
import os
import re
from collections.abc import Mapping
from typing import TypeVar, overload

import torch
from peft import PeftModel

from mergecompose.merging.lazy_tensors import SafetensorsCheckpoint
from mergecompose.merging.lora import lora_delta_weights
from mergecompose.merging.state_dicts import (
    check_finite,
    check_same_keys,
    check_same_kind,
    check_same_shape,
    compute_dtype,
    is_mergeable,
    share_updates_of_tied,
    state_dict_of,
)

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)

_LAYER = re.compile(r"^(?P<prefix>.*?\b(?:layers?|h|blocks?)\.\d+)\.")  # model.layers.3., transformer.h.3.


class TaskVector:
    """A task vector τ = θ_ft − θ_base: one tensor per parameter name.

    Only floating-point tensors are kept (integer and bool buffers are skipped, as in the task
    vectors' reference code). Differences are stored in float32 (float64 if an input is float64)
    so that bf16/fp16 checkpoints lose no precision in the subtraction. Operations never modify a
    task vector in place; each returns a new one.

    A tensor present in one task vector and absent from another counts as zero in `+`, `-` and
    `cosine` (a LoRA task vector covers only the adapted modules). Shapes must match.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        for name, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"task vector tensor `{name}` must be a floating-point tensor, got {kind}")
        self.tensors: dict[str, torch.Tensor] = dict(tensors)

    # ---- builders -------------------------------------------------------------------------

    @classmethod
    def from_state_dicts(
        cls, base: Mapping[str, torch.Tensor], finetuned: Mapping[str, torch.Tensor], *, allow_nonfinite: bool = False
    ) -> TaskVector:
        """τ[name] = finetuned[name] − base[name] for every floating-point tensor.

        Raises ValueError if the names differ, a pair of shapes differs, a floating-point tensor is
        not floating-point in the other (an int64 copy would silently count as no change), or,
        unless `allow_nonfinite`, a tensor holds NaN or inf (each naming the tensor).
        """
        base = state_dict_of(base, "base")
        finetuned = state_dict_of(finetuned, "finetuned")
        check_same_keys(set(base), set(finetuned))
        tensors: dict[str, torch.Tensor] = {}
        for name, base_tensor in base.items():
            _add_difference(tensors, name, base_tensor, finetuned[name], ("base", "finetuned"), allow_nonfinite)
        return cls(tensors)

    @classmethod
    def from_models(
        cls, base_model: torch.nn.Module, finetuned_model: torch.nn.Module, *, allow_nonfinite: bool = False
    ) -> TaskVector:
        """The task vector of two models with the same architecture (their state dicts)."""
        return cls.from_state_dicts(
            state_dict_of(base_model, "base_model"),
            state_dict_of(finetuned_model, "finetuned_model"),
            allow_nonfinite=allow_nonfinite,
        )

    @classmethod
    def from_checkpoints(
        cls, base_dir: str | os.PathLike, finetuned_dir: str | os.PathLike, *, allow_nonfinite: bool = False
    ) -> TaskVector:
        """The task vector of two safetensors checkpoint folders, read one tensor pair at a time.

        Peak memory is the task vector plus one tensor pair, never two full models. Errors name
        the folders; non-finite weights are refused unless `allow_nonfinite`.
        """
        base, finetuned = SafetensorsCheckpoint(base_dir, "base"), SafetensorsCheckpoint(finetuned_dir, "finetuned")
        what = (f"base {str(base_dir)!r}", f"finetuned {str(finetuned_dir)!r}")
        check_same_keys(set(base.keys()), set(finetuned.keys()), what)
        tensors: dict[str, torch.Tensor] = {}
        for name in base.keys():
            check_same_shape(name, base.shape(name), finetuned.shape(name), what)  # before reading either tensor
            _add_difference(tensors, name, base.get(name), finetuned.get(name), what, allow_nonfinite)
        return cls(tensors)

    @classmethod
    def from_lora(
        cls, base_model: torch.nn.Module, adapter: str | os.PathLike | PeftModel, *, allow_nonfinite: bool = False
    ) -> TaskVector:
        """The dense task vector of a peft LoRA adapter: ΔW = scaling · B @ A for every adapted module.

        `adapter` is a peft adapter folder (or hub id) or a PeftModel (its active adapter).
        `scaling` is peft's: lora_alpha / r, or lora_alpha / √r with rsLoRA, per module with
        rank_pattern / alpha_pattern; `modules_to_save` copies contribute their difference to the
        base. DoRA adapters raise a ValueError: their merged weight m · (W + ΔW) / ‖W + ΔW‖ is not
        W + ΔW. Non-finite adapter weights are refused unless `allow_nonfinite`. See
        `mergecompose.merging.lora.lora_delta_weights`.
        """
        return cls(lora_delta_weights(base_model, adapter, allow_nonfinite=allow_nonfinite))

    # ---- algebra --------------------------------------------------------------------------

    def _combine(self, other: object, sign: float) -> TaskVector:
        if not isinstance(other, TaskVector):
            raise ValueError(f"a task vector can only be added to a task vector, got {type(other).__name__}")
        tensors = dict(self.tensors)
        for name, tensor in other.tensors.items():
            if name in tensors:
                check_same_shape(name, tensors[name].shape, tensor.shape, what=("left operand", "right operand"))
                tensors[name] = tensors[name] + sign * tensor
            else:
                tensors[name] = sign * tensor
        return TaskVector(tensors)

    def __add__(self, other: TaskVector) -> TaskVector:
        return self._combine(other, 1.0)

    def __radd__(self, other: object) -> TaskVector:
        if isinstance(other, numbers.Number) and other == 0:  # sum([τ1, τ2]) starts from 0
            return self
        return self._combine(other, 1.0)

    def __sub__(self, other: TaskVector) -> TaskVector:
        return self._combine(other, -1.0)

    def __neg__(self) -> TaskVector:
        return TaskVector({name: -tensor for name, tensor in self.tensors.items()})

    def __mul__(self, scalar: float) -> TaskVector:
        if isinstance(scalar, bool) or not isinstance(scalar, numbers.Real):
            raise ValueError(f"a task vector can only be multiplied by a real scalar, got {type(scalar).__name__}")
        if not math.isfinite(scalar):
            raise ValueError(f"the scalar a task vector is multiplied by must be a finite real number, got {scalar!r}")
        products = {name: tensor * float(scalar) for name, tensor in self.tensors.items()}
        for name, product in products.items():
            # A finite scalar can still overflow the dtype (1e300 · float32 → inf); NaN or inf already in the
            # task vector (built with allow_nonfinite=True) is the caller's and stays.
            overflowed = ~torch.isfinite(product) & torch.isfinite(self.tensors[name])
            if overflowed.any():
                raise ValueError(
                    f"the scalar a task vector is multiplied by must keep it finite, got {scalar!r}: tensor `{name}` "
                    f"{tuple(product.shape)} overflows {product.dtype} in {int(overflowed.sum())} entries"
                )
        return TaskVector(products)

    __rmul__ = __mul__

    # ---- measurements ---------------------------------------------------------------------

    def norm(self) -> float:
        """The L2 norm over all tensors, ‖τ‖ = √(Σ_name ‖τ[name]‖²), accumulated in float64."""
        return math.sqrt(sum(float(tensor.double().pow(2).sum()) for tensor in self.tensors.values()))

    def dot(self, other: TaskVector) -> float:
        """⟨τ, σ⟩ over the shared tensor names (a missing tensor is zero), in float64."""
        total = 0.0
        for name, tensor in self.tensors.items():
            if name in other.tensors:
                check_same_shape(name, tensor.shape, other.tensors[name].shape, what=("left operand", "right operand"))
                total += float((tensor.double() * other.tensors[name].double()).sum())
        return total

    def cosine(self, other: TaskVector) -> float:
        """cos(τ, σ) = ⟨τ, σ⟩ / (‖τ‖ ‖σ‖). Raises ValueError if either task vector is zero."""
        if not isinstance(other, TaskVector):
            raise ValueError(f"`other` must be a TaskVector, got {type(other).__name__}")
        norms = self.norm(), other.norm()
        if norms[0] == 0 or norms[1] == 0:
            raise ValueError("the cosine is undefined for a zero task vector (norm 0)")
        return self.dot(other) / (norms[0] * norms[1])

    def layer_norms(self) -> dict[str, float]:
        """L2 norm per layer: tensors under `...layers.<i>.` (or `h.<i>.`, `blocks.<i>.`) are grouped.

        A tensor outside every layer is a group of its own, under its name.
        """
        squares: dict[str, float] = {}
        for name, tensor in self.tensors.items():
            match = _LAYER.match(name)
            group = match["prefix"] if match else name
            squares[group] = squares.get(group, 0.0) + float(tensor.double().pow(2).sum())
        return {group: math.sqrt(value) for group, value in squares.items()}

    # ---- application ----------------------------------------------------------------------

    @overload
    def apply_to(self, base: ModuleT, scale: float = 1.0) -> ModuleT: ...

    @overload
    def apply_to(self, base: Mapping[str, torch.Tensor], scale: float = 1.0) -> dict[str, torch.Tensor]: ...

    def apply_to(
        self, base: torch.nn.Module | Mapping[str, torch.Tensor], scale: float = 1.0
    ) -> torch.nn.Module | dict[str, torch.Tensor]:
        """θ = θ_base + scale · τ, cast back to each base tensor's dtype.

        `base` is a state dict (a new state dict is returned) or a torch module (a deep copy with
        the new weights is returned). The input is never modified. Tensors of the base that the
        task vector does not cover are copied unchanged, except names tied to a covered one
        (lm_head tied to embed_tokens), which get the same update.
        """
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
            raise ValueError(f"`scale` must be a finite real number, got {scale!r}")
        base_state = state_dict_of(base, "base")
        for name, tensor in self.tensors.items():
            if name not in base_state:
                raise ValueError(f"the task vector has tensor `{name}`, which `base` does not have")
            check_same_shape(name, base_state[name].shape, tensor.shape, what=("base", "task vector"))
        result = {}
        for name, tensor in self.tensors.items():
            base_tensor = base_state[name]
            dtype = compute_dtype(base_tensor.dtype, tensor.dtype)
            updated = base_tensor.to(dtype) + float(scale) * tensor.to(device=base_tensor.device, dtype=dtype)
            result[name] = updated.to(base_tensor.dtype)
        share_updates_of_tied(base_state, result)
        result = {name: result[name] if name in result else tensor.clone() for name, tensor in base_state.items()}
        if isinstance(base, torch.nn.Module):
            model = copy.deepcopy(base)
            model.load_state_dict(result)
            return model
        return result

    def __repr__(self) -> str:
        count = sum(tensor.numel() for tensor in self.tensors.values())
        return f"TaskVector({len(self.tensors)} tensors, {count} parameters, norm={self.norm():.4g})"


def _add_difference(
    tensors: dict[str, torch.Tensor],
    name: str,
    base: torch.Tensor,
    finetuned: torch.Tensor,
    what: tuple[str, str],
    allow_nonfinite: bool,
) -> None:
    """`tensors[name] = finetuned − base` in their common float dtype; integer and bool buffers are skipped."""
    check_same_shape(name, base.shape, finetuned.shape, what)
    check_same_kind(name, base, finetuned, what)
    if is_mergeable(base):
        if not allow_nonfinite:
            check_finite(name, base, what[0])
            check_finite(name, finetuned, what[1])
        dtype = compute_dtype(base.dtype, finetuned.dtype)
        tensors[name] = finetuned.to(dtype) - base.to(dtype)
