"""A `type: lm_eval` config where the lm-eval extra is missing (its compare kind never registered) is told which
extra to install, not given pydantic's list of unknown fields."""

from __future__ import annotations

import shutil

import pytest

import mergecompose.experiments.config as experiment_config
from mergecompose.experiments.config import load_config


def test_a_kind_whose_extra_is_missing_names_the_extra(tmp_path, monkeypatch):
    config = tmp_path / "letters_lm_eval.yaml"
    shutil.copy("configs/letters_lm_eval.yaml", config)
    without = {name: kind for name, kind in experiment_config.COMPARE_KINDS.items() if name != "lm_eval"}
    monkeypatch.setattr(experiment_config, "COMPARE_KINDS", without)
    with pytest.raises(
        ValueError, match=r'`task.type: lm_eval` needs the lm-eval extra.*pip install "mergecompose\[lm-eval\]"'
    ):
        load_config(config)
