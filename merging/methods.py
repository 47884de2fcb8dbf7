"""The registry of merge methods: one name each; a duplicate name is an error.

| method          | sparsify             | signs | normalize (paper / mergekit) | reference |
|-----------------|----------------------|-------|------------------------------|-----------|
| linear          | –                    | –     | True / True (Σ w)            | model soups, arXiv:2203.05482 |
| task_arithmetic | –                    | –     | False / False                | arXiv:2212.04089 |
| ties            | magnitude (global)   | yes   | True / True (disjoint mean)  | arXiv:2306.01708 |
| dare_linear     | random, 1/(1−p)      | –     | False / False                | arXiv:2311.03099 |
| dare_ties       | random, 1/(1−p)      | yes   | True / False                 | arXiv:2311.03099 |
| magnitude_prune | magnitude per tensor | –     | False / False                | peft `merge_utils.magnitude_prune` |
| breadcrumbs     | outliers per tensor  | –     | False / False                | arXiv:2312.06795 |

The normalize column gives the default under the papers' definitions and under mergekit's, which are
those of mergekit's registry (its dare_ties does not normalise). Each entry holds the pydantic model
of its parameters (`METHODS["ties"].settings`, see `mergecompose.merging.method_settings`) and says whether
mergekit runs it under the same name (all but magnitude_prune), which is what `merge_checkpoints` offers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

import torch
from pydantic import ValidationError

from mergecompose.core.import_paths import is_import_path
from mergecompose.merging.generalized_task_arithmetic import GeneralizedTaskArithmetic
from mergecompose.merging.linear import Linear
from mergecompose.merging.method_settings import (
    BreadcrumbsSettings,
    DareLinearSettings,
    DareTiesSettings,
    MagnitudePruneSettings,
    MergeSettings,
    TaskArithmeticSettings,
    TiesSettings,
    readable_error,
)
from mergecompose.merging.user_methods import resolve_user_method

SettingsT = TypeVar("SettingsT", bound=MergeSettings)


class MergeMethod(Protocol[SettingsT]):
    """What `register` takes: a name, the settings model of its parameters, whether mergekit runs it, and the merge."""

    @property
    def name(self) -> str: ...

    @property
    def settings(self) -> type[SettingsT]: ...

    @property
    def mergekit(self) -> bool: ...

    def __call__(
        self,
        base: Mapping[str, torch.Tensor],
        task_vectors: Sequence[Mapping[str, torch.Tensor]],
        settings: SettingsT,
        progress: bool = False,
    ) -> dict[str, torch.Tensor]: ...


_REGISTRY: dict[str, MergeMethod[Any]] = {}

# Read-only view: the methods cannot be replaced from outside; use `register`.
METHODS = MappingProxyType(_REGISTRY)


def register(method: MergeMethod[Any]) -> None:
    """Add a method under its name: `.name`, `.settings` (its pydantic model), `.mergekit` and `__call__`."""
    if method.name in _REGISTRY:
        raise ValueError(f"merge method `{method.name}` is already registered")
    _REGISTRY[method.name] = method


def get_method(name: str) -> MergeMethod[Any]:
    """The method registered as `name`, or the user's method that import path `name` (`package.module:Name`)
    names (`mergecompose.merging.user_methods`); an unknown name lists the valid ones."""
    if is_import_path(name):
        return resolve_user_method(name, "method")
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown merge method {name!r}; valid methods: {sorted(_REGISTRY)}, or a method of your own "
            "as an import path `package.module:Name`"
        )
    return _REGISTRY[name]


def mergekit_methods() -> list[str]:
    """The methods mergekit runs under the same name, i.e. those `merge_checkpoints` offers."""
    return [name for name, method in _REGISTRY.items() if method.mergekit]


def validate_merge_params(method: str, params: Mapping, *, count: int | None = None) -> MergeSettings:
    """The settings of one `method` merge, validated by its model (`METHODS[method].settings`).

    `params` are the method's keywords (a None value means the method's default); `count`, the
    number of inputs where known, checks `weights` against it and fills in the default weights.
    Validates a whole merge grid at config load time, before any work.

    `method` may be a user's import path `package.module:Name` (`mergecompose.merging.user_methods`): its
    settings' `method` is filled with that path.

    Raises:
        ValueError: an unknown method (the valid ones are listed), an unknown parameter (the
            method's are listed), or a value out of range (one line per field, naming it, the
            value received and the range).
    """
    settings = get_method(method).settings
    if not isinstance(params, Mapping):
        raise ValueError(
            f"`params` of `{method}` must be a mapping of parameter names to values, got {type(params).__name__}"
        )
    params = dict(params)
    if is_import_path(method):  # a user's settings model takes its name, the import path, as `method`
        if "method" in params:
            raise ValueError(f"`method` is not a parameter of `{method}`; its name is the import path")
        params["method"] = method
    try:
        return settings.model_validate(params, context={"count": count})
    except ValidationError as error:
        raise readable_error(error, settings, f"`{method}`") from None


for _method in (
    Linear(),
    GeneralizedTaskArithmetic(
        settings=TaskArithmeticSettings,
        sparsification=None,
        sign_consensus=False,
        reference="https://arxiv.org/abs/2212.04089",
        mergekit=True,
    ),
    GeneralizedTaskArithmetic(
        settings=TiesSettings,
        sparsification="magnitude",
        sign_consensus=True,
        reference="https://arxiv.org/abs/2306.01708",
        mergekit=True,
    ),
    GeneralizedTaskArithmetic(
        settings=DareLinearSettings,
        sparsification="random",
        sign_consensus=False,
        reference="https://arxiv.org/abs/2311.03099",
        mergekit=True,
    ),
    GeneralizedTaskArithmetic(
        settings=DareTiesSettings,
        sparsification="random",
        sign_consensus=True,
        reference="https://arxiv.org/abs/2311.03099",
        mergekit=True,
    ),
    GeneralizedTaskArithmetic(
        settings=MagnitudePruneSettings,
        sparsification="magnitude",
        sign_consensus=False,
        reference="peft.utils.merge_utils.magnitude_prune",
        mergekit=False,  # mergekit has no plain magnitude pruning
    ),
    GeneralizedTaskArithmetic(
        settings=BreadcrumbsSettings,
        sparsification="outliers",
        sign_consensus=False,
        reference="https://arxiv.org/abs/2312.06795",
        mergekit=True,
    ),
):
    register(_method)
del _method
