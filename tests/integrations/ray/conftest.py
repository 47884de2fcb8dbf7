"""What the Ray tests share: one local Ray instance of 2 CPUs for the whole folder (each start costs seconds), and
a scaled predict config (one family of letter skills, two settings) whose sweep is a few cells."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mergecompose.integrations.ray import RayExecutor
from mergecompose.integrations.ray import executor as ray_executor

ROOT = Path(__file__).resolve().parents[3]
SMALL = {
    "name": "small",
    "test_size": 16,
    "validation_size": 8,
    "diagnostic_prompts": 8,
    "bootstrap": 200,
    "batch_size": 64,
    "merges": {"task_arithmetic": {"lam": [0.5, 1.0]}},
    "families": {
        "letters": {
            "compare": str(ROOT / "configs/letters.yaml"),
            "overrides": {
                "task": {"train_lengths": [1, 8]},
                "positions": {"max_position": 32},
                "evaluation": {"lengths": [8]},
                "model": {"hidden_size": 32, "max_position_embeddings": 32},
                "training": {
                    "base": {"steps": 100, "batch_size": 32, "lr": 0.005},
                    "experts": {"full": {"steps": 40, "batch_size": 32, "lr": 0.003}},
                },
            },
            "letter_skills": {"ab": {"A": "B"}, "cd": {"C": "D"}, "ac": {"A": "C"}},
            "settings": [{"name": "ab_cd", "pair": ["ab", "cd"]}, {"name": "ab_ac", "pair": ["ab", "ac"]}],
        },
    },
}


@pytest.fixture(scope="package")
def local_ray():
    """A local Ray instance of 2 CPUs for the folder's tests (each module skips itself without Ray)."""
    executor = RayExecutor(num_cpus=2)
    executor.start()
    yield executor
    ray_executor.ray.shutdown()


@pytest.fixture(scope="package")
def config_file(tmp_path_factory) -> Path:
    """SMALL as a predict config file."""
    path = tmp_path_factory.mktemp("predict_config") / "predict.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    return path
