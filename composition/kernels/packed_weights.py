"""A linear's weight held in oneDNN's packed layout, in place, and the memory that packing gives back.

Where torch has oneDNN (`torch.backends.mkldnn`), a float32 weight is reordered once into oneDNN's blocked layout
for a few rows (`torch.ops.mkldnn._reorder_linear_weight`, what torch's own CPU compiler does for linears) and
multiplied by `torch.ops.mkldnn._linear_pointwise` (`Packed`). Packing is in place (`hold_packed`): each module's
weight parameter keeps its identity but holds an empty tensor while the packed copy (the same bytes, reordered)
serves every forward, so memory does not grow. Siblings that read one input (q/k/v, gate/up: `SAME_INPUT`) are
packed as one matrix (`PackedGroup`): the first to run computes the product for all and the others take their
columns of it (`PackedSibling`), so a decoder layer runs 4 oneDNN products at a step instead of 7 (at a few rows a
call costs far more than its arithmetic; benchmarks/README.md). Meanwhile `state_dict()` gives the dense weight, a
deep copy packs its own, and `load_state_dict` makes the module dense again with what it loads.

Which modules are packed, whether packing pays on this machine, and giving the dense weights back are
`FewRowLinears`' (few_row_linear.py).
"""

from __future__ import annotations

import copy
import ctypes
import functools
import os
import sys
from collections.abc import Iterable
from typing import TypeVar, cast

import torch

T = TypeVar("T")

# The instance attribute of a module whose weight is packed (`Packed`).
PACKED = "_few_rows_packed"


def can_pack(weight: torch.Tensor) -> bool:
    """True if `weight` can be held in oneDNN's packed layout: a float32 CPU matrix, with oneDNN in this torch."""
    return (
        torch.backends.mkldnn.is_available()
        and type(weight.data) is torch.Tensor
        and weight.layout == torch.strided
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.numel() > 0
    )


class Packed:
    """A linear's weight reordered into oneDNN's blocked layout for `rows` rows (an opaque tensor, same values)."""

    def __init__(self, dense: torch.Tensor, rows: int) -> None:
        self.rows = rows
        self.tensor = torch.ops.mkldnn._reorder_linear_weight(dense.detach(), rows)

    def dense(self) -> torch.Tensor:
        """The weight in its ordinary layout: a new tensor, equal bit for bit to the one packed."""
        return self.tensor.to_dense()

    def __deepcopy__(self, memo: dict) -> Packed:
        return Packed(self.dense(), self.rows)  # an opaque tensor has no storage to copy


# Linears of one parent that read the same input, in the architectures transformers ships (their names): packed as
# one matrix (`PackedGroup`), and their LoRA factors A side by side (kernels/stacked_lora.py).
SAME_INPUT = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"}, {"query", "key", "value"}, {"w1", "w3"})


def reads_same(kept: torch.Tensor | None, version: int | None, x: torch.Tensor) -> bool:
    """True if `x` is the tensor `kept` was when `version` was read: the same memory, layout, dtype and version.

    Each linear is given its own view of its input (a reshape), so identity says nothing; `kept` holds that
    memory, so no other tensor can have been given its address meanwhile. An inference tensor (made under
    `torch.inference_mode`) has no version counter (`version` None): an in-place change to it could not be
    seen, so it never reads the same."""
    return (
        kept is not None
        and version is not None
        and kept.data_ptr() == x.data_ptr()
        and kept.shape == x.shape
        and kept.stride() == x.stride()
        and kept.dtype == x.dtype
        and version == x._version
    )


def version_of(x: torch.Tensor) -> int | None:
    """`x`'s version counter, None for an inference tensor (which has none)."""
    return None if x.is_inference() else x._version


class PackedGroup:
    """Siblings' weights stacked, [W_1; W_2; …; E] (Σ out + e, in), and packed as one: one oneDNN product serves them.

    The first sibling to run computes x [W_1; W_2; …; E]ᵀ; each sibling then given the same input unchanged
    (`reads_same`) takes its columns of it, once; a sibling given another input, or its own columns a second
    time, computes the product anew. E (e, in), optional, are extra rows that one member's addition reads (the
    LoRA factors A of kernels/stacked_lora.py): their product comes with the weights' for the cost of their bytes.
    A group may have one member, with extra rows."""

    def __init__(self, dense: torch.Tensor, rows: int, sizes: list[int], extra: tuple[int, int] | None = None) -> None:
        self.rows, self.sizes, self.extra = rows, sizes, extra  # extra: (the member that reads them, e)
        self.tensor = torch.ops.mkldnn._reorder_linear_weight(dense.detach(), rows)
        self.x: torch.Tensor | None = None  # the input of the kept product, its version, the product
        self.version: int | None = None
        self.output: torch.Tensor | None = None
        self.taken: set[int] = set()  # the siblings that took their columns of it

    def dense(self) -> torch.Tensor:
        return self.tensor.to_dense()

    def product(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """x [W_1; W_2; …]ᵀ (N, Σ out), computed anew unless sibling `index` has not yet taken this input's.

        Once every sibling has taken its columns, the product and its input are let go: kept until the pass's
        end, a prompt pass's products of every layer would be held at once."""
        output = self.output
        if output is None or index in self.taken or not reads_same(self.x, self.version, x):
            output = torch.ops.mkldnn._linear_pointwise(x, self.tensor, None, "none", [], "")
            self.x, self.version, self.output, self.taken = x, version_of(x), output, set()
        self.taken.add(index)
        if len(self.taken) == len(self.sizes):
            self.clear()
        return output

    def clear(self) -> None:
        self.x, self.version, self.output, self.taken = None, None, None, set()

    def __deepcopy__(self, memo: dict) -> PackedGroup:
        return PackedGroup(self.dense(), self.rows, self.sizes, self.extra)  # an opaque tensor has no storage


class PackedSibling:
    """One module's rows of a `PackedGroup`."""

    def __init__(self, group: PackedGroup, index: int) -> None:
        self.group, self.index = group, index
        self.start = sum(group.sizes[:index])
        self.end = self.start + group.sizes[index]
        # The columns of the group's extra rows, if this member reads them.
        self.extra: slice | None = None
        if group.extra is not None and group.extra[0] == index:
            total = sum(group.sizes)
            self.extra = slice(total, total + group.extra[1])

    def dense(self) -> torch.Tensor:
        """This module's weight in its ordinary layout: a new tensor, equal bit for bit to the one packed."""
        return self.group.dense()[self.start : self.end].clone()

    def __deepcopy__(self, memo: dict) -> PackedSibling:
        return PackedSibling(copy.deepcopy(self.group, memo), self.index)  # siblings copied together share one


def _dense_in_state_dict(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """A state-dict post-hook: a packed module's weight as its dense matrix, not the empty placeholder."""
    packed = module.__dict__.get(PACKED)
    if packed is not None and prefix + "weight" in state_dict:
        state_dict[prefix + "weight"] = packed.dense()


def _unpack_before_loading(module: torch.nn.Module, *_: object) -> None:
    """A load-state-dict pre-hook: a packed module gets its dense weight back, which the load then overwrites
    (a deep copy made while a composition is open, as `TaskVector.apply_to` makes, loads its new weights)."""
    packed = module.__dict__.pop(PACKED, None)
    if packed is not None:
        module._parameters["weight"].data = packed.dense()  # type: ignore[union-attr]


def hold_packed(module: torch.nn.Module, packed: Packed | PackedSibling) -> list[torch.utils.hooks.RemovableHandle]:
    """Hold `module`'s weight as `packed` (module docstring): its dense bytes are freed, the parameter stays the same
    object, holding an empty tensor, and state-dict hooks give the dense weight; returns the hooks' handles."""
    weight = cast(torch.nn.Parameter, module._parameters["weight"])
    module.__dict__[PACKED] = packed
    _release_pages(weight)
    weight.data = weight.data.new_empty(0)  # the dense bytes are freed; the parameter stays the same object
    return [
        module.register_state_dict_post_hook(_dense_in_state_dict),
        module.register_load_state_dict_pre_hook(_unpack_before_loading),
    ]


def _release_pages(weight: torch.Tensor) -> None:
    """Give the pages of `weight`'s bytes back to the system now, where nothing else holds them (Linux).

    A checkpoint loaded from safetensors keeps its tensors in a file mapping, whose pages stay resident when a
    tensor is dropped; `madvise(MADV_DONTNEED)` on the pages that hold only this tensor's bytes releases them
    (a private file mapping refills a page from the file if it is read again; nothing reads these). Skipped
    where another tensor shares the storage, or the call is not available."""
    if not sys.platform.startswith("linux"):
        return
    storage = weight.untyped_storage()
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    # Two uses: the parameter's tensor and `storage` here. More: an alias somewhere else still reads the bytes.
    if use_count is None or use_count(storage._cdata) > 2:
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-storage.data_ptr() // page) * page  # whole pages inside the tensor's bytes only
    end = (storage.data_ptr() + storage.nbytes()) // page * page
    if end > start:
        _libc().madvise(start, end - start, _MADV_DONTNEED)


_MADV_DONTNEED = 4


def trim_heap() -> None:
    """Give the free memory of the C heap back to the system (glibc's `malloc_trim`, Linux): packing copies each
    group's weights into a temporary matrix, and the heap keeps the pages of those it freed; so do timing trials."""
    if sys.platform.startswith("linux") and hasattr(_libc(), "malloc_trim"):
        _libc().malloc_trim(0)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def same_input_siblings(items: Iterable[tuple[str, T]]) -> list[list[T]]:
    """Of `(module path, item)` pairs, the items of siblings named in `SAME_INPUT` under one parent, two or more,
    in the order given."""
    by_parent: dict[tuple[str, int], list[T]] = {}
    for path, item in items:
        parent, _, name = path.rpartition(".")
        for index, names in enumerate(SAME_INPUT):
            if name in names:
                by_parent.setdefault((parent, index), []).append(item)
    return [members for members in by_parent.values() if len(members) > 1]
