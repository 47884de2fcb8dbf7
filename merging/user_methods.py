"""A user's merge method, named by its import path `package.module:Name`, resolved when asked.

Nothing registers itself: a config, the command line or `merge(...)` names the method by its import
path, and `resolve_user_method` imports it (`mergecompose.core.import_paths`). The object named is
one of:

- a plain function whose `settings` parameter is annotated with its settings model, as a mergekit
  method is one typed function:

      class BiggestSettings(MergeSettings):
          lam: float = 1.0

      def biggest(base, task_vectors, settings: BiggestSettings) -> dict[str, torch.Tensor]: ...

- an object with `.settings` (its settings model) and `__call__(base, task_vectors, settings,
  progress=False)`: the `MergeMethod` protocol of `mergecompose.merging.methods`, which the built-ins
  implement (`.name` and `.mergekit` are ignored: the name is the import path, and mergekit runs only
  its own methods);
- a class whose no-argument instance is such an object.

`base` maps each floating-point tensor name to θ_base; `task_vectors` is a list of k mappings
name -> τ_i (a name may be missing from one); the method returns the merged θ (not a difference) for
the names it merges, and a name it leaves out keeps θ_base.

The settings model is a subclass of `MergeSettings` (weights, normalize and the convention keywords
come with it) that leaves `method` as it is, a string: the merge fills it with the import path, so the
resolved settings written beside a merged model say which code made it. Its fields are the method's
parameters, validated like a built-in's (`validate_merge_params`). A user method runs in memory only
(`mergecompose.merging.merge`, `mergecompose merge` with our typed config, `mergecompose compare`);
mergekit's YAML keeps mergekit's methods.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mergecompose.core.import_paths import resolve_import_path
from mergecompose.merging.method_settings import MergeSettings

_SIGNATURE = "(base, task_vectors, settings: YourSettings) -> dict"


@dataclass(frozen=True)
class UserMergeMethod:
    """A user's merge method as the registry's methods look: its import path as `name`, its settings model,
    and the call (`progress` is passed on only to a method that takes it)."""

    name: str
    settings: type[MergeSettings]
    function: Callable[..., Any]
    takes_progress: bool
    mergekit: bool = False  # mergekit runs only its own methods

    def __call__(
        self,
        base: Mapping[str, torch.Tensor],
        task_vectors: Sequence[Mapping[str, torch.Tensor]],
        settings: MergeSettings,
        progress: bool = False,
    ) -> dict[str, torch.Tensor]:
        extra = {"progress": progress} if self.takes_progress else {}
        merged = self.function(base, task_vectors, settings, **extra)
        return _checked_result(self.name, merged, base)


def import_path_of(method: object, argument: str = "method") -> str:
    """`method` as a name `merge` takes: a string as it is; a function or class, defined at the top of an importable
    module, as its import path `module:Name`; an instance as its class's path (which `resolve_user_method` builds
    again without arguments). So the resolved settings name code that can be found again.

    Raises:
        ValueError: an object that its import path does not give back (a function defined inside another, a
            lambda, an object whose module cannot be imported).
    """
    if isinstance(method, str):
        return method
    target = method if inspect.isfunction(method) or isinstance(method, type) else type(method)
    path = f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', '?')}"
    try:
        found = resolve_import_path(path, argument)
    except ValueError:
        found = None
    if found is not target:
        raise ValueError(
            f"`{argument}` {method!r} cannot be named by an import path ({path!r} does not give it back): define it "
            "at the top of a module, or pass its import path `package.module:Name`"
        )
    return path


def resolve_user_method(value: str, argument: str = "method") -> UserMergeMethod:
    """The merge method that import path `value` names (see the module's docstring for what it may be).

    Raises:
        ValueError (one line, naming `argument` and `value`): the path is malformed or does not import, the
            object is neither a typed function nor an object with `settings` and `__call__` (the missing
            attribute is named), a class that cannot be built without arguments, or a settings model that is not
            a `MergeSettings` subclass or narrows `method`.
    """
    target = resolve_import_path(value, argument)
    where = f"`{argument}` {value!r}"
    if isinstance(target, type):
        if issubclass(target, MergeSettings):
            raise ValueError(
                f"{where} names a settings model; name the merge method (a function {_SIGNATURE}, or an object "
                "with `settings` and `__call__`)"
            )
        try:
            target = target()
        except Exception as error:  # the user's constructor: reported in one line
            raise ValueError(
                f"{where} is a class that cannot be built without arguments ({type(error).__name__}: {error}); "
                "name an instance, or give every argument a default"
            ) from None
    if not callable(target):
        raise ValueError(
            f"{where} is a {type(target).__name__}, not a merge method: a function {_SIGNATURE}, or an object "
            "with `settings` and `__call__(base, task_vectors, settings, progress=False)`"
        )
    if hasattr(target, "settings"):
        settings, function = target.settings, target
    elif inspect.isfunction(target):
        settings, function = _annotated_settings(target, where), target
    else:
        raise ValueError(
            f"{where} has no attribute `settings`: a merge method object needs `settings` (its MergeSettings "
            f"model) and `__call__`; a plain function needs its `settings` parameter annotated {_SIGNATURE}"
        )
    _check_settings_model(settings, where)
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin without a signature: call it with the three arguments
        parameters = {}  # type: ignore[assignment]
    return UserMergeMethod(value, settings, function, takes_progress="progress" in parameters)


def _annotated_settings(function: Callable[..., Any], where: str) -> object:
    """The annotation of `function`'s `settings` parameter (its third), resolved."""
    names = list(inspect.signature(function).parameters)
    if len(names) < 3:
        raise ValueError(f"{where} takes {names}; a merge function takes {_SIGNATURE}")
    try:
        hints = typing.get_type_hints(function)
    except Exception as error:  # an annotation that does not resolve
        raise ValueError(f"{where}: its annotations do not resolve ({type(error).__name__}: {error})") from None
    if names[2] not in hints:
        raise ValueError(
            f"{where} has no settings model: annotate its parameter `{names[2]}` with a MergeSettings subclass, "
            f"{_SIGNATURE}"
        )
    return hints[names[2]]


def _check_settings_model(settings: object, where: str) -> None:
    if not (isinstance(settings, type) and issubclass(settings, MergeSettings)):
        raise ValueError(
            f"{where}: its settings model must be a subclass of mergecompose.merging.MergeSettings, got {settings!r}"
        )
    if settings.model_fields["method"].annotation is not str:
        raise ValueError(
            f"{where}: its settings model {settings.__name__} redeclares `method`; leave it out (the merge fills it "
            "with the import path)"
        )


def _checked_result(name: str, merged: object, base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The user method's result, refused unless it maps names of `base` to tensors of their shapes."""
    if not isinstance(merged, Mapping):
        raise ValueError(
            f"merge method {name!r} returned a {type(merged).__name__}; it must return a dict of tensor name -> θ"
        )
    for tensor_name, tensor in merged.items():
        if tensor_name not in base:
            raise ValueError(f"merge method {name!r} returned tensor `{tensor_name}`, which the base does not have")
        if not isinstance(tensor, torch.Tensor) or tensor.shape != base[tensor_name].shape:
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(
                f"merge method {name!r} returned {got} for `{tensor_name}`; the base's is "
                f"{tuple(base[tensor_name].shape)}"
            )
    return dict(merged)
