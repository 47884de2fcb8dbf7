"""The parameters of each merge method, as one typed (pydantic) model per method.

A method family is one general model configured, as in mergekit: TIES is magnitude pruning plus
sign consensus, DARE-TIES is DARE plus sign consensus:

    MergeSettings ── LinearSettings
                  └─ TaskArithmeticSettings ── MagnitudePruneSettings ── BreadcrumbsSettings
                                            │                        └─ TiesSettings (+ SignConsensus)
                                            └─ DareLinearSettings ── DareTiesSettings (+ SignConsensus)

Validating fills in the defaults of the definition the method follows, so a model is the resolved
record of one merge: what `merge(..., out_dir=...)` writes next to its output, and what a YAML
file can hold. None for a parameter means the method's default. Each registry entry holds its
model (`METHODS["ties"].settings`); `mergecompose.merging.methods.validate_merge_params` validates by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

if TYPE_CHECKING:
    from typing_extensions import Self

Consensus = Literal["paper", "mergekit"]
SignElection = Literal["mass", "count"]
TrimScope = Literal["global", "per_tensor"]
Rescale = Literal["inverse", "l1"]


def _within(interval: str, contains: Callable[[float], bool]) -> AfterValidator:
    def check(value: float) -> float:
        if not contains(value):
            raise ValueError(f"must be in {interval}")
        return value

    return AfterValidator(check)


Density = Annotated[float, _within("(0, 1]", lambda value: 0.0 < value <= 1.0)]
Rate = Annotated[float, _within("[0, 1)", lambda value: 0.0 <= value < 1.0)]
Seed = Annotated[int, Field(ge=0)]


class MergeSettings(BaseModel):
    """What every method takes: the weights, normalize, and the convention keywords.

    Convention keywords (consensus, sign_election, trim_scope, rescale, seed) are accepted by
    every method, so one set of them (`MERGEKIT_MODE`, a seed) fits every method; they are
    checked always and recorded only by the methods they apply to, which redeclare them.
    """

    # strict: no "0.5" for 0.5, no True for 1.0; floats must be finite.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    # Each method's model narrows `method` to its own name; mypy takes a Literal of another name for an
    # incompatible override, hence the `type: ignore[assignment]` on those declarations.
    method: str
    weights: list[float] | None = Field(None, validate_default=True, description="w_i per input, default 1.0 each")
    consensus: Consensus = Field("paper", exclude=True)
    sign_election: SignElection = Field("mass", exclude=True)
    trim_scope: TrimScope = Field("per_tensor", exclude=True)
    rescale: Rescale = Field("inverse", exclude=True)
    seed: Seed = Field(0, exclude=True)
    normalize: bool = False

    # normalize=True divides by Σ w; sign-elected merges divide by the agreeing entries instead.
    divides_by_weight_sum: ClassVar[bool] = True

    @model_validator(mode="before")
    @classmethod
    def _none_is_the_default(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            return {name: value for name, value in data.items() if value is not None}
        return data

    @field_validator("weights", mode="before")
    @classmethod
    def _weights_as_list(cls, weights: Any) -> Any:
        """Any sequence of numbers (a tuple, a tensor, an array); torch / numpy scalars become numbers."""
        if isinstance(weights, (str, bytes, Mapping)) or not hasattr(weights, "__len__"):
            return weights  # the type check reports it
        return [weight.item() if hasattr(weight, "item") else weight for weight in weights]

    @field_validator("weights")
    @classmethod
    def _one_weight_per_input(cls, weights: list[float] | None, info: ValidationInfo) -> list[float] | None:
        """With the number of inputs (validation context `count`): one weight each, default 1.0."""
        count = (info.context or {}).get("count")
        if count is None:
            return weights
        if weights is None:
            return [1.0] * count
        if len(weights) != count:
            raise ValueError(f"must hold one weight per input ({count})")
        return weights

    @model_validator(mode="after")
    def _weight_sum_is_not_zero(self) -> Self:
        if self.normalize and self.divides_by_weight_sum and self.weights and abs(sum(self.weights)) < 1e-8:
            raise ValueError(f"`weights` sum to {sum(self.weights)}; normalize=True divides by that sum")
        return self


class LinearSettings(MergeSettings):
    """Weight averaging (model soups): θ = Σ_i w_i θ_i / Σ_i w_i; no λ (scale with `weights`)."""

    method: Literal["linear"] = "linear"
    normalize: bool = True


class TaskArithmeticSettings(MergeSettings):
    """θ = θ_base + λ Σ_i w_i τ_i."""

    method: Literal["task_arithmetic"] = "task_arithmetic"
    lam: float = Field(1.0, description="λ, the scale of the merged task vector")


class MagnitudePruneSettings(TaskArithmeticSettings):
    """Task arithmetic on task vectors trimmed to their largest-magnitude entries."""

    method: Literal["magnitude_prune"] = "magnitude_prune"  # type: ignore[assignment]
    trim_scope: TrimScope = "per_tensor"
    density: Density = Field(description="in (0, 1], the fraction of entries kept")


class BreadcrumbsSettings(MagnitudePruneSettings):
    """Magnitude pruning that also drops the largest `gamma` of the entries (outliers), per tensor."""

    method: Literal["breadcrumbs"] = "breadcrumbs"  # type: ignore[assignment]
    gamma: Rate = Field(0.01, description="in [0, 1), the fraction of largest entries removed")

    @model_validator(mode="after")
    def _per_tensor(self) -> Self:
        if self.trim_scope != "per_tensor":
            raise ValueError(f"`trim_scope` must be 'per_tensor' for `{self.method}`, got {self.trim_scope!r}")
        return self


class DareLinearSettings(TaskArithmeticSettings):
    """Task arithmetic on task vectors with entries dropped at random (DARE), the rest rescaled."""

    method: Literal["dare_linear"] = "dare_linear"  # type: ignore[assignment]
    seed: Seed = 0
    rescale: Rescale = Field(default_factory=lambda data: "l1" if data.get("consensus") == "mergekit" else "inverse")
    density: Density | None = Field(None, description="1 − drop_rate; give one of the two")
    drop_rate: Rate | None = Field(
        default_factory=lambda data: None if data.get("density") is None else 1.0 - data["density"],
        description="in [0, 1), DARE's p",
    )

    @model_validator(mode="after")
    def _drop_rate_or_density(self) -> Self:
        if {"density", "drop_rate"} <= self.model_fields_set:
            raise ValueError(f"give `drop_rate` or `density` (= 1 − drop_rate) for `{self.method}`, not both")
        if self.drop_rate is None:
            raise ValueError(f"`{self.method}` needs `drop_rate` in [0, 1) (or `density` = 1 − drop_rate)")
        return self


class SignConsensus(BaseModel):
    """Elect a sign per entry and keep only the entries that agree with it (TIES); λ > 0.

    A mixin, listed first: `class TiesSettings(SignConsensus, MagnitudePruneSettings)`. It derives
    from BaseModel only, because pydantic takes an inherited field from the first base that has
    it, so a first base holding every field would override the second base's declarations.
    """

    consensus: Consensus = "paper"
    sign_election: SignElection = "mass"
    normalize: bool = True

    divides_by_weight_sum: ClassVar[bool] = False

    if TYPE_CHECKING:  # fields of the settings it is mixed into (not fields of its own)
        method: str
        lam: float

    @model_validator(mode="after")
    def _positive_lam(self) -> Self:
        if self.lam <= 0:
            raise ValueError(
                f"`lam` must be > 0 for `{self.method}` (a sign-elected merge scaled by λ ≤ 0 flips "
                f"or erases the elected signs), got {self.lam}"
            )
        return self


class TiesSettings(SignConsensus, MagnitudePruneSettings):
    """TIES: magnitude pruning (global, as in the paper), sign election, disjoint mean."""

    method: Literal["ties"] = "ties"  # type: ignore[assignment]
    trim_scope: TrimScope = "global"


class DareTiesSettings(SignConsensus, DareLinearSettings):
    """DARE's random drop with TIES's sign election; mergekit does not normalise by default."""

    method: Literal["dare_ties"] = "dare_ties"  # type: ignore[assignment]
    normalize: bool = Field(default_factory=lambda data: data.get("consensus") != "mergekit")


def parameter_names(settings: type[BaseModel]) -> list[str]:
    """The keywords a method takes: every field of its settings but `method`."""
    return [name for name in settings.model_fields if name != "method"]


# Our words for pydantic's error types; the others keep pydantic's message.
_REASONS = {
    "float_type": "must be a finite real number",
    "finite_number": "must be a finite real number",
    "int_type": "must be an integer",
    "bool_type": "must be True or False (or None for the method's default)",
    "list_type": "must be a list",
    "greater_than_equal": "must be >= {ge}",
    "literal_error": "must be {expected}",
    "extra_forbidden": "is not a known field",
}


def readable_error(error: ValidationError, model: type[BaseModel], subject: str) -> ValueError:
    """pydantic's ValidationError, raised by validating `model`, as a ValueError with one line per wrong field.

    Each line names the field, the value received and what is allowed:
    "`density` must be in (0, 1], got 1.5". `subject` names what was validated ("`ties`"); an
    unknown field lists the valid ones, a missing one gives its description. Errors of a whole
    model are sentences already and are kept as they are.
    """
    lines = []
    for item in error.errors(include_url=False):
        kind, location, context = item["type"], item["loc"], item.get("ctx", {})
        name = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in location).lstrip(".")
        if kind == "default_factory_not_called":
            continue  # a field it depends on is wrong, and has its own line
        if kind == "missing":
            field = model.model_fields.get(name)
            description = f": {field.description}" if field is not None and field.description else ""
            lines.append(f"{subject} needs `{name}`{description}")
        elif kind == "extra_forbidden" and len(location) == 1:
            lines.append(f"`{name}` does not apply to {subject}; valid parameters: {', '.join(parameter_names(model))}")
        elif kind == "value_error" and not location:
            lines.append(str(context["error"]))
        elif kind == "value_error":
            lines.append(f"`{name}` {context['error']}, got {item['input']!r}")
        elif kind in _REASONS:
            lines.append(f"`{name}` {_REASONS[kind].format(**context)}, got {item['input']!r}")
        else:
            lines.append(f"`{name}`: {item['msg']}, got {item['input']!r}")
    return ValueError("\n".join(lines))


class NamedBySettings:
    """Mixin of a merge method: its name is its settings model's `method`, so it is written once."""

    settings: type[MergeSettings]

    @property
    def name(self) -> str:
        return self.settings.model_fields["method"].default
