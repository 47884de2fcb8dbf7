"""A four-label rule: "merge", "compose", "either" or "neither" from one or two label-free diagnostics.

`LabelRule` is a decision tree of depth at most two whose cuts read at most two diagnostics, kept as nested
`Cut`s and `Leaf`s so that it is read (and shipped in JSON) without the library that fitted it
(`mergecompose.studies.predict.label_fit` fits it with scikit-learn). A cut sends a setting whose diagnostic is
`<= threshold` to `below`, the others to `above`, as scikit-learn's trees do. Where a diagnostic the rule reads is
undefined on a setting (None or NaN), the rule answers its `fallback`, the label most of its training settings
carry: it never says "undecided".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Label = Literal["merge", "compose", "either", "neither"]
MAX_DIAGNOSTICS = 2


class Leaf(BaseModel):
    """The label a branch of the tree ends in."""

    model_config = ConfigDict(extra="forbid")

    label: Label


class Cut(BaseModel):
    """`feature <= threshold` goes to `below`, the rest to `above`."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    feature: str = Field(min_length=1)
    threshold: float
    below: Cut | Leaf
    above: Cut | Leaf


def _features(node: Cut | Leaf) -> list[str]:
    if isinstance(node, Leaf):
        return []
    names = [node.feature, *_features(node.below), *_features(node.above)]
    return list(dict.fromkeys(names))


def _depth(node: Cut | Leaf) -> int:
    return 0 if isinstance(node, Leaf) else 1 + max(_depth(node.below), _depth(node.above))


def _undefined(value: object) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


class LabelRule(BaseModel):
    """The tree (`root`), the label it answers where a diagnostic it reads is undefined (`fallback`), and how
    it was fitted (`n_settings`, `training_accuracy`; `heldout`: its held-out figures, where measured)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    root: Cut | Leaf
    fallback: Label
    n_settings: int = Field(ge=1)
    training_accuracy: float = Field(ge=0, le=1)
    heldout: dict | None = None

    @model_validator(mode="after")
    def _small(self) -> LabelRule:
        if len(self.features()) > MAX_DIAGNOSTICS or _depth(self.root) > 2:
            raise ValueError(
                f"a label rule reads at most {MAX_DIAGNOSTICS} diagnostics at depth at most 2, got "
                f"{self.features()} at depth {_depth(self.root)}"
            )
        return self

    def features(self) -> list[str]:
        """The diagnostics the rule reads, root first."""
        return _features(self.root)

    def verdict(self, diagnostics: Mapping[str, float | None]) -> str:
        """One of the four labels: the leaf `diagnostics` reach, or `fallback` where a cut on the way reads an
        undefined diagnostic (missing, None or NaN)."""
        node = self.root
        while isinstance(node, Cut):
            value = diagnostics.get(node.feature)
            if _undefined(value):
                return self.fallback
            node = node.below if value <= node.threshold else node.above
        return node.label

    def describe(self) -> str:
        """The rule in one line, e.g. `x <= 0.2 ? (y <= 1 ? merge : either) : compose`."""

        def text(node: Cut | Leaf) -> str:
            if isinstance(node, Leaf):
                return node.label
            below, above = text(node.below), text(node.above)
            if isinstance(node.below, Cut):
                below = f"({below})"
            if isinstance(node.above, Cut):
                above = f"({above})"
            return f"{node.feature} <= {node.threshold:.4g} ? {below} : {above}"

        return f"{text(self.root)}; where undefined: {self.fallback}"
