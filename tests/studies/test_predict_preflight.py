"""The pre-flights of `predict-sweep` and `overlap-sweep` on the shipped configs: relative `compare:` paths are read
from the config's own folder, so they pass from any working directory; nothing is trained or written."""

from __future__ import annotations

from pathlib import Path

import pytest

from mergecompose.core.io import load_yaml_config
from mergecompose.studies.letters.overlap_sweep import SweepConfig, preflight_overlap_sweep
from mergecompose.studies.predict import PredictConfig, preflight_predict

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_the_shipped_predict_config_passes_its_preflight_from_another_folder(tmp_path, monkeypatch):
    path = CONFIGS / "predict.yaml"
    config = load_yaml_config(path, PredictConfig, "predict config")
    assert all(not Path(family.compare).is_absolute() for family in config.families.values())
    monkeypatch.chdir(tmp_path)
    preflight_predict(config, path)  # every family and setting, each compare config read from configs/
    assert list(tmp_path.iterdir()) == []  # nothing written
    # Without the config's own path, a relative `compare` is read from the working directory: here, nowhere.
    with pytest.raises(ValueError, match=r"family 'letters_coupled': compare config` 'letters\.yaml': does not exist"):
        preflight_predict(config)


@pytest.mark.parametrize("name", ["sweep_letters.yaml", "sweep_letters_weak.yaml"])
def test_the_shipped_sweep_configs_pass_their_preflight_from_another_folder(name, tmp_path, monkeypatch):
    path = CONFIGS / name
    config = load_yaml_config(path, SweepConfig, "sweep config")
    monkeypatch.chdir(tmp_path)
    preflight_overlap_sweep(config, path)
    assert config.compare_config(path).model.hidden_size > 0
    assert list(tmp_path.iterdir()) == []
