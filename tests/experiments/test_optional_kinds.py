"""A `type: lm_eval` config where the lm-eval extra is missing (its compare kind's entry point does not import) is
told which extra to install, not given pydantic's list of unknown fields."""

from __future__ import annotations

import shutil
from importlib.metadata import EntryPoint, entry_points

import pytest

from mergecompose.experiments import plugins
from mergecompose.experiments.compare_config import load_config


def test_a_kind_whose_extra_is_missing_names_the_extra(tmp_path, monkeypatch):
    config = tmp_path / "letters_lm_eval.yaml"
    shutil.copy("configs/letters_lm_eval.yaml", config)

    def without_lm_eval(group: str) -> list[EntryPoint]:
        found = list(entry_points(group=group))
        if group != plugins.COMPARE_KIND_GROUP:
            return found
        # The lm_eval kind as it loads where its extra is missing: its module's import fails.
        missing = EntryPoint("lm_eval", "mergecompose_tests_not_installed.run:LM_EVAL_KIND", group)
        return [missing if entry.name == "lm_eval" else entry for entry in found]

    monkeypatch.setattr(plugins, "_REGISTRY", plugins._Registry())
    monkeypatch.setattr(plugins, "entry_points", without_lm_eval)
    with pytest.raises(
        ValueError, match=r'`task.type: lm_eval` needs the lm-eval extra.*pip install "mergecompose\[lm-eval\]"'
    ):
        load_config(config)
    assert plugins.missing_extra("lm_eval") == "lm-eval" and "lm_eval" not in plugins.compare_kinds()
