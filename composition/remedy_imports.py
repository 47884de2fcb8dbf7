"""A user's remedy named by its import path, as configs, `--remedy` and lm-eval's `remedies=` name it.

    {class: my_package.remedies:Temper, alpha: 0.5}

`class` is the import path of a class (or any callable) that makes the remedy; the other keys are its
keyword arguments. A parameter named `eos_token_id` that the entry does not give receives the tokenizer's
end-of-sequence id, as `TerminationRule` does. The entry is checked when it is validated, before any model
loads: the path imports (`mergecompose.core.import_paths`), the keywords are ones the callable takes,
calling it works (with `eos_token_id=0` where it is filled in later), and what it makes implements the
phase it declares (`mergecompose.composition.remedy_phases.remedy_phase`).

A dump writes the entry back with `source_sha256`, the hash of the module's source file, so that a
config's fingerprint changes when the user's code does; validation ignores that key.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from mergecompose.composition.remedy_phases import remedy_phase
from mergecompose.core.import_paths import resolve_import_path, source_hash

CLASS_KEY = "class"
SOURCE_KEY = "source_sha256"  # written by dumps, ignored on validation
_FILLED_IN = "eos_token_id"  # given by the caller when the entry does not give it


class ImportedRemedy(BaseModel):
    """One user remedy: its import path (`class`) and its keyword arguments."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    path: str = Field(alias="class")
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _parameters_beside_class(cls, data: Any) -> Any:
        """`{class: PATH, alpha: 0.5}` -> `{class: PATH, params: {alpha: 0.5}}`."""
        if isinstance(data, Mapping) and CLASS_KEY in data and "params" not in data:
            params = {key: value for key, value in data.items() if key not in (CLASS_KEY, SOURCE_KEY)}
            return {CLASS_KEY: data[CLASS_KEY], "params": params}
        return data

    @model_validator(mode="after")
    def _makes_a_remedy(self) -> ImportedRemedy:
        self.build(eos_token_id=0)
        return self

    def __hash__(self) -> int:  # frozen, but `params` is a dict
        return hash((self.path, json.dumps(self.params, sort_keys=True, default=repr)))

    @model_serializer(mode="plain")
    def _dump(self) -> dict[str, Any]:
        return {CLASS_KEY: self.path, **self.params, SOURCE_KEY: source_hash(self.path)}

    def build(self, eos_token_id: int) -> object:
        """The remedy: the callable at `path` called with `params` (and `eos_token_id` if it takes one)."""
        factory = resolve_import_path(self.path, CLASS_KEY)
        if not callable(factory):
            raise ValueError(
                f"`{CLASS_KEY}` {self.path!r} must name a class (or callable) that makes a remedy, got "
                f"{type(factory).__name__}"
            )
        keywords = {**self.params}
        accepted = _keywords(factory)
        if accepted is not None:
            unknown = sorted(set(keywords) - accepted)
            if unknown:
                raise ValueError(
                    f"`{CLASS_KEY}` {self.path!r} takes no parameter {', '.join(map(repr, unknown))}; "
                    f"it takes {sorted(accepted - {_FILLED_IN}) or 'none'}"
                )
            if _FILLED_IN in accepted and _FILLED_IN not in keywords:
                keywords[_FILLED_IN] = eos_token_id
        try:
            remedy = factory(**keywords)
        except Exception as error:  # the user's own check of its parameters, reported in one line
            arguments = ", ".join(f"{name}={value!r}" for name, value in self.params.items())
            raise ValueError(f"`{CLASS_KEY}` {self.path}({arguments}): {type(error).__name__}: {error}") from None
        try:
            remedy_phase(remedy)
        except ValueError as error:
            raise ValueError(f"`{CLASS_KEY}` {self.path!r} does not make a remedy: {error}") from None
        return remedy


def _keywords(factory: Callable[..., object]) -> set[str] | None:
    """The keyword names `factory` takes (None where it takes any, `**kwargs`, or cannot be inspected)."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return None
    return {
        parameter.name
        for parameter in parameters
        if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
