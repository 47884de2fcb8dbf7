"""The task-type registry: filled from the entry points in one place, one name each, a clear error for a duplicate
or an unknown name, the protocol checked."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
from pydantic import BaseModel

from mergecompose.experiments import (
    CompareConfig,
    TaskType,
    get_task_type,
    load_config,
    plugins,
    register_task_type,
    task_types,
)
from mergecompose.studies.letters import LettersTaskSettings
from mergecompose.studies.skills import SkillsTaskSettings


def test_both_task_types_are_registered_and_satisfy_the_protocol():
    assert dict(task_types()) == {"letters": LettersTaskSettings, "skills": SkillsTaskSettings}
    assert isinstance(LettersTaskSettings(), TaskType)
    assert get_task_type("skills") is SkillsTaskSettings


def test_a_duplicate_name_is_an_error_and_leaves_the_registry_as_it_was():
    with pytest.raises(ValueError, match="task type 'letters' is already registered"):
        register_task_type("letters")(LettersTaskSettings)
    assert task_types()["letters"] is LettersTaskSettings


def test_an_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown task type 'sorting'; valid: \['letters', 'skills'\]"):
        get_task_type("sorting")


def test_a_type_missing_part_of_the_protocol_is_refused():
    class Half(BaseModel):
        type: str = "half"

        def title(self) -> str:
            return "half a task"

    with pytest.raises(TypeError, match="lacks .*'eval_data'"):
        register_task_type("half")(Half)
    assert "half" not in task_types()


def test_the_config_picks_the_model_by_type_and_defaults_to_letters():
    letters = CompareConfig.model_validate({"training": {"base": {"steps": 1}, "experts": {"full": {"steps": 1}}}})
    assert type(letters.task) is LettersTaskSettings
    assert "type" not in letters.model_dump(mode="json")["task"]  # left out of dumps: hashes stay as they were
    skills = load_config("configs/skills_k3_test.yaml")
    assert type(skills.task) is SkillsTaskSettings and skills.model_dump(mode="json")["task"]["type"] == "skills"
    assert CompareConfig.model_validate(skills.model_dump(mode="json")) == skills  # round trip


def test_the_registry_is_filled_from_the_entry_points_not_by_imports(monkeypatch):
    """Every task type and compare kind is an entry point of the package; a registry without entry points is
    empty though every module that defines one is imported already (nothing registers itself on import)."""
    assert {entry.name for entry in entry_points(group=plugins.TASK_TYPE_GROUP)} == set(task_types())
    assert {entry.name for entry in entry_points(group=plugins.COMPARE_KIND_GROUP)} == set(plugins.compare_kinds())
    assert set(plugins.compare_kinds()) == {"lm_eval", "math_code"}
    monkeypatch.setattr(plugins, "_REGISTRY", plugins._Registry())
    monkeypatch.setattr(plugins, "entry_points", lambda group: [])
    assert dict(task_types()) == {} and dict(plugins.compare_kinds()) == {}
