"""The registry of merge methods: one name each; a duplicate name is an error.

| method          | sparsify             | signs | normalize default (paper / mergekit) | reference |
|-----------------|----------------------|-------|--------------------------------------|-----------|
| linear          | –                    | –     | True / True (Σ w)                    | model soups, arXiv:2203.05482 |
| task_arithmetic | –                    | –     | False / False                        | arXiv:2212.04089 |
| ties            | magnitude (global)   | yes   | True / True (disjoint mean)          | arXiv:2306.01708 |
| dare_linear     | random, 1/(1−p)      | –     | False / False                        | arXiv:2311.03099 |
| dare_ties       | random, 1/(1−p)      | yes   | True / False                         | arXiv:2311.03099 |
| magnitude_prune | magnitude per tensor | –     | False / False                        | peft `merge_utils.magnitude_prune` |
| breadcrumbs     | outliers per tensor  | –     | False / False                        | arXiv:2312.06795 |

"mergekit" defaults are those of mergekit's registry (its dare_ties does not normalise).
"""

from __future__ import annotations

from types import MappingProxyType

from merging.generalized_task_arithmetic import GeneralizedTaskArithmetic
from merging.linear import Linear

_REGISTRY: dict = {}

# Read-only view: the methods cannot be replaced from outside; use `register`.
METHODS = MappingProxyType(_REGISTRY)


def register(method) -> None:
    """Add a method (with `.name`, `.resolve(count, **params)` and `__call__`) under its name."""
    if method.name in _REGISTRY:
        raise ValueError(f"merge method `{method.name}` is already registered")
    _REGISTRY[method.name] = method


def get_method(name: str):
    """The method registered as `name`; an unknown name lists the valid ones."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown merge method {name!r}; valid methods: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


_NEVER = MappingProxyType({"paper": False, "mergekit": False})

for _method in (
    Linear(),
    GeneralizedTaskArithmetic(
        name="task_arithmetic",
        sparsification=None,
        sign_consensus=False,
        normalize_default=_NEVER,
        reference="https://arxiv.org/abs/2212.04089",
    ),
    GeneralizedTaskArithmetic(
        name="ties",
        sparsification="magnitude",
        sign_consensus=True,
        normalize_default=MappingProxyType({"paper": True, "mergekit": True}),
        reference="https://arxiv.org/abs/2306.01708",
        trim_scope_default="global",
    ),
    GeneralizedTaskArithmetic(
        name="dare_linear",
        sparsification="random",
        sign_consensus=False,
        normalize_default=_NEVER,
        reference="https://arxiv.org/abs/2311.03099",
    ),
    GeneralizedTaskArithmetic(
        name="dare_ties",
        sparsification="random",
        sign_consensus=True,
        normalize_default=MappingProxyType({"paper": True, "mergekit": False}),
        reference="https://arxiv.org/abs/2311.03099",
    ),
    GeneralizedTaskArithmetic(
        name="magnitude_prune",
        sparsification="magnitude",
        sign_consensus=False,
        normalize_default=_NEVER,
        reference="peft.utils.merge_utils.magnitude_prune",
    ),
    GeneralizedTaskArithmetic(
        name="breadcrumbs",
        sparsification="outliers",
        sign_consensus=False,
        normalize_default=_NEVER,
        reference="https://arxiv.org/abs/2312.06795",
        global_trim_allowed=False,
    ),
):
    register(_method)
del _method
