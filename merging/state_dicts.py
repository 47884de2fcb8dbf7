"""Named tensors at the edge of every merge: dtypes, shape and name checks, state dicts, tied weights."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float32, or float64 if any input is float64: differences of bf16/fp16 weights are taken in float32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def is_mergeable(tensor: torch.Tensor) -> bool:
    """Floating-point tensors are merged; integer and bool buffers are skipped, as in the task-vector code."""
    return tensor.is_floating_point()


NONFINITE_HINT = "pass allow_nonfinite=True (--allow-nonfinite on the command line) to merge it anyway"
_CHUNK = 1 << 24  # entries per isfinite pass: bounded extra memory on large tensors


def nonfinite_counts(tensor: torch.Tensor) -> tuple[int, int]:
    """(NaN count, ±inf count) of a floating-point tensor, 0 for others; the common finite case costs one pass."""
    if not tensor.is_floating_point():
        return 0, 0
    flat = tensor.detach().reshape(-1)
    chunks = flat.split(_CHUNK)
    if all(bool(torch.isfinite(chunk).all()) for chunk in chunks):
        return 0, 0
    nan = sum(int(torch.isnan(chunk).sum()) for chunk in chunks)
    return nan, sum(int(torch.isinf(chunk).sum()) for chunk in chunks)


def check_finite(name: str, tensor: torch.Tensor, where: str, hint: str = NONFINITE_HINT) -> None:
    """Raise a ValueError naming `where` (the input), the tensor and its NaN / inf counts if any entry is not finite."""
    nan, inf = nonfinite_counts(tensor)
    if nan or inf:
        raise ValueError(
            f"{where} has non-finite weights: tensor `{name}` {tuple(tensor.shape)} holds {nan} NaN and {inf} inf "
            f"values; {hint}"
        )


def check_finite_tensors(tensors: Mapping[str, torch.Tensor], where: str, hint: str = NONFINITE_HINT) -> None:
    for name, tensor in tensors.items():
        check_finite(name, tensor, where, hint)


def check_same_kind(
    name: str, base: torch.Tensor, other: torch.Tensor, what: tuple[str, str] = ("base", "finetuned")
) -> None:
    """Both floating-point (merged) or both not (buffers, skipped): an integer copy of a float weight is refused.

    Skipping it would silently give the base's value (an int64 expert merged to the base).
    """
    if base.is_floating_point() != other.is_floating_point():
        raise ValueError(
            f"dtype mismatch for tensor `{name}`: {what[0]} has {base.dtype}, {what[1]} has {other.dtype}; "
            "weights are merged only between floating-point tensors (was it saved with the wrong dtype?)"
        )


def check_same_shape(
    name: str,
    first: torch.Size | tuple[int, ...],
    second: torch.Size | tuple[int, ...],
    what: tuple[str, str] = ("base", "finetuned"),
) -> None:
    if tuple(first) != tuple(second):
        raise ValueError(
            f"shape mismatch for tensor `{name}`: {what[0]} has shape {tuple(first)}, "
            f"{what[1]} has shape {tuple(second)}"
        )


def check_same_keys(first: set[str], second: set[str], what: tuple[str, str] = ("base", "finetuned")) -> None:
    if first != second:
        only_first, only_second = sorted(first - second), sorted(second - first)
        raise ValueError(
            f"tensor names differ: only in {what[0]}: {only_first[:5]}{' ...' if len(only_first) > 5 else ''}; "
            f"only in {what[1]}: {only_second[:5]}{' ...' if len(only_second) > 5 else ''}"
        )


def state_dict_of(model_or_state_dict: object, argument: str) -> dict[str, torch.Tensor]:
    """A detached {name: tensor} view of a torch module or a mapping of tensors (no copy)."""
    if isinstance(model_or_state_dict, torch.nn.Module):
        return {name: tensor.detach() for name, tensor in model_or_state_dict.state_dict().items()}
    if isinstance(model_or_state_dict, Mapping):
        for name, tensor in model_or_state_dict.items():
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"`{argument}` must map names to tensors, but `{name}` is a {type(tensor).__name__}")
        return {name: tensor.detach() for name, tensor in model_or_state_dict.items()}
    raise ValueError(
        f"`{argument}` must be a torch module or a state dict (mapping of names to tensors), "
        f"got {type(model_or_state_dict).__name__}"
    )


def tied_groups(state: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Names that share one tensor (tied weights, e.g. lm_head and embed_tokens), groups of ≥ 2."""
    groups: dict[tuple, list[str]] = {}
    for name, tensor in state.items():
        if tensor.numel() > 0:
            key = (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
            groups.setdefault(key, []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def share_updates_of_tied(state: Mapping[str, torch.Tensor], updated: dict[str, torch.Tensor]) -> None:
    """Give every name tied to an updated name the same update, in place in `updated`.

    A checkpoint of a tied model stores the shared tensor once (e.g. only embed_tokens), so a
    task vector read from it updates one name; loading a state dict whose other name still holds
    the old value would overwrite the update.
    """
    for names in tied_groups(state):
        changed = [name for name in names if name in updated]
        for name in names:
            if changed and name not in updated:
                updated[name] = updated[changed[0]]
