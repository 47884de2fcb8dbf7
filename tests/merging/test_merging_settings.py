"""One pydantic model per merge method: defaults of each definition, and errors that name the
field, the value and the range (one line per field), an unknown parameter or method listing the
valid ones."""

import pydantic
import pytest
import torch

from mergecompose.merging import MERGEKIT_MODE, METHODS, TaskVector, merge, validate_merge_params
from mergecompose.merging.checkpoints import CheckpointMergeConfig, load_merge_config
from mergecompose.merging.method_settings import (
    DareLinearSettings,
    MagnitudePruneSettings,
    SignConsensus,
    TaskArithmeticSettings,
    TiesSettings,
)
from mergecompose.merging.methods import mergekit_methods

BASE = {"w": torch.zeros(2)}
TAU = TaskVector({"w": torch.tensor([1.0, -2.0])})


def test_every_method_holds_its_model_named_after_it():
    for name, method in METHODS.items():
        assert method.name == name == method.settings.model_fields["method"].default
    # Families are configured variants: TIES is magnitude pruning with sign consensus.
    assert issubclass(TiesSettings, MagnitudePruneSettings) and issubclass(TiesSettings, SignConsensus)
    assert issubclass(DareLinearSettings, TaskArithmeticSettings)
    assert METHODS["ties"].settings is TiesSettings


def test_defaults_follow_each_definition():
    ties = validate_merge_params("ties", {"density": 0.2})
    assert (ties.trim_scope, ties.consensus, ties.sign_election, ties.normalize, ties.lam) == (
        "global",
        "paper",
        "mass",
        True,
        1.0,
    )
    assert validate_merge_params("magnitude_prune", {"density": 0.2}).trim_scope == "per_tensor"
    assert validate_merge_params("breadcrumbs", {"density": 0.2}).gamma == 0.01
    assert validate_merge_params("linear", {}).normalize is True
    assert validate_merge_params("task_arithmetic", {}).normalize is False
    # DARE: density is 1 − drop_rate; paper: 1/(1 − p) rescale, dare_ties normalises; mergekit: L1, does not.
    dare = validate_merge_params("dare_ties", {"density": 0.25})
    assert (dare.drop_rate, dare.rescale, dare.normalize, dare.seed) == (0.75, "inverse", True, 0)
    dare = validate_merge_params("dare_ties", {"drop_rate": 0.5, **MERGEKIT_MODE})
    assert (dare.rescale, dare.normalize) == ("l1", False)
    assert validate_merge_params("dare_linear", {"drop_rate": 0.5, "consensus": "mergekit"}).rescale == "l1"
    # None means the method's default.
    assert validate_merge_params("ties", {"density": 0.2, "normalize": None, "lam": None}) == ties


def test_weights_are_filled_in_and_checked_against_the_number_of_inputs():
    assert validate_merge_params("linear", {}).weights is None
    assert validate_merge_params("linear", {}, count=3).weights == [1.0, 1.0, 1.0]
    assert validate_merge_params("linear", {"weights": (1, 2)}, count=2).weights == [1.0, 2.0]
    assert validate_merge_params("linear", {"weights": torch.tensor([0.5, 2.0])}, count=2).weights == [0.5, 2.0]
    with pytest.raises(ValueError, match=r"^`weights` must hold one weight per input \(3\), got \[1.0, 2.0\]$"):
        validate_merge_params("linear", {"weights": [1.0, 2.0]}, count=3)
    with pytest.raises(ValueError, match=r"^`weights\[1\]` must be a finite real number, got inf$"):
        validate_merge_params("task_arithmetic", {"weights": [1.0, float("inf")]})


def test_the_record_holds_only_what_applies():
    record = validate_merge_params("task_arithmetic", {"lam": 0.5, "seed": 3, **MERGEKIT_MODE}, count=1).model_dump()
    assert record == {"method": "task_arithmetic", "weights": [1.0], "normalize": False, "lam": 0.5}
    record = validate_merge_params("dare_linear", {"drop_rate": 0.5, "seed": 3, **MERGEKIT_MODE}).model_dump()
    assert (
        record["seed"] == 3 and record["rescale"] == "l1" and "consensus" not in record and "trim_scope" not in record
    )
    settings = validate_merge_params("ties", {"density": 0.5})
    with pytest.raises(pydantic.ValidationError):
        settings.density = 0.9  # frozen


@pytest.mark.parametrize(
    "method, params, message",
    [
        ("ties", {"density": 1.5}, r"^`density` must be in \(0, 1\], got 1.5$"),
        ("ties", {"density": "0.5"}, r"^`density` must be a finite real number, got '0.5'$"),
        ("task_arithmetic", {"lam": True}, r"^`lam` must be a finite real number, got True$"),
        ("ties", {"density": 0.5, "normalize": 1}, r"^`normalize` must be True or False .*, got 1$"),
        ("dare_linear", {"drop_rate": 0.5, "seed": -1}, r"^`seed` must be >= 0, got -1$"),
        ("ties", {"density": 0.5, "sign_election": "vote"}, r"^`sign_election` must be 'mass' or 'count', got 'vote'$"),
        ("magnitude_prune", {}, r"^`magnitude_prune` needs `density`: in \(0, 1\], the fraction of entries kept$"),
        ("dare_ties", {"density": 0.5, "lam": 0.0}, r"^`lam` must be > 0 for `dare_ties`"),
    ],
)
def test_each_error_names_the_field_the_value_and_the_range(method, params, message):
    with pytest.raises(ValueError, match=message) as raised:
        validate_merge_params(method, params)
    assert not isinstance(raised.value, pydantic.ValidationError)


def test_one_line_per_wrong_field():
    with pytest.raises(ValueError) as raised:
        validate_merge_params("ties", {"density": 2.0, "lam": float("nan"), "gamma": 0.1})
    lines = str(raised.value).splitlines()
    assert lines == [
        "`lam` must be a finite real number, got nan",
        "`density` must be in (0, 1], got 2.0",
        "`gamma` does not apply to `ties`; valid parameters: weights, consensus, sign_election, trim_scope, "
        "rescale, seed, normalize, lam, density",
    ]


def test_unknown_parameter_lists_the_methods_parameters():
    with pytest.raises(ValueError, match=r"`densty` does not apply to `ties`; valid parameters: .*\blam, density$"):
        merge("ties", BASE, [TAU], densty=0.5, progress=False)
    with pytest.raises(ValueError, match=r"`drop_rate` does not apply to `magnitude_prune`; valid parameters: "):
        validate_merge_params("magnitude_prune", {"density": 0.5, "drop_rate": 0.1})
    # Convention keywords fit every method: one MERGEKIT_MODE and one seed for all of them.
    for name in METHODS:
        params = {"density": 0.5} if "density" in METHODS[name].settings.model_fields else {}
        validate_merge_params(name, {**params, **MERGEKIT_MODE, "seed": 1})


def test_unknown_method_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown merge method 'tie'; valid methods: \['breadcrumbs', .*'ties'\]"):
        validate_merge_params("tie", {"density": 0.5})
    with pytest.raises(ValueError, match=r"`params` of `ties` must be a mapping"):
        validate_merge_params("ties", [("density", 0.5)])


def test_a_merge_grid_is_validated_before_any_work():
    grid = {"ties": [{"lam": 0.5, "density": 0.2}, {"lam": 1.0, "density": 0.8}], "dare_ties": [{"drop_rate": 0.5}]}
    settings = [validate_merge_params(method, point) for method, points in grid.items() for point in points]
    assert [s.method for s in settings] == ["ties", "ties", "dare_ties"]
    with pytest.raises(ValueError, match=r"`density` must be in \(0, 1\], got 0.0"):
        for method, points in {"ties": [{"density": 0.5}, {"density": 0.0}]}.items():
            for point in points:
                validate_merge_params(method, point)


def test_mergekit_methods_come_from_the_registry():
    assert mergekit_methods() == [name for name, method in METHODS.items() if method.mergekit]
    assert "magnitude_prune" not in mergekit_methods() and "ties" in mergekit_methods()
    config = {"method": "magnitude_prune", "base": "b", "experts": ["e"], "density": 0.5}
    with pytest.raises(
        ValueError,
        match=r"^`method` must be one of the methods mergekit runs, \['linear', .*\], got 'magnitude_prune'$",
    ):
        load_merge_config(config)


def test_checkpoint_config_is_validated_by_the_method_model():
    config = {"method": "ties", "base": "b", "experts": ["e", {"path": "f", "weight": 0.5}], "density": 0.3}
    assert CheckpointMergeConfig.model_validate(config).settings().weights == [1.0, 0.5]
    # Errors reach the user as plain one-line ValueErrors.
    for change, message in [
        ({"density": 1.5}, r"^`density` must be in \(0, 1\], got 1.5$"),
        ({"gamma": 0.1}, r"^`gamma` does not apply to `ties`; valid parameters: "),
        ({"trim_scope": "global"}, r"^`trim_scope` is 'per_tensor' on disk \(mergekit's definition\), got 'global'"),
        ({"weights": [1.0, 2.0]}, r"^`weights` are given per expert"),
        ({"experts": []}, r"^`experts` must list at least one checkpoint, got \[\]$"),
    ]:
        with pytest.raises(ValueError, match=message) as raised:
            load_merge_config({**config, **change})
        assert not isinstance(raised.value, pydantic.ValidationError)
    # What mergekit does anyway may be said.
    assert load_merge_config({**config, **MERGEKIT_MODE})[1].settings().consensus == "mergekit"
