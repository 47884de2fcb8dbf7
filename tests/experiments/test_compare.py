"""`mergecompose compare` end to end on a scaled-down config: files, schema, caching, refusals, CLI."""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import yaml

from mergecompose.cli import main
from mergecompose.experiments import compare as compare_module
from mergecompose.experiments import compare_command as experiments_cli
from mergecompose.experiments.compare import run_compare
from mergecompose.experiments.compare_config import CompareConfig, load_config
from mergecompose.experiments.trained_models import prepare_components

SMALL = {
    "name": "small",
    "task": {"train_lengths": [1, 6]},
    "positions": {"scheme": "coupled", "randomize": True, "max_position": 48},
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "max_position_embeddings": 48},
    "training": {
        "base": {"steps": 150, "batch_size": 32, "lr": 0.005},
        "experts": {
            "full": {"steps": 40, "batch_size": 32, "lr": 0.002},
            "lora": {"rank": 4, "alpha": 8, "training": {"steps": 40, "batch_size": 32, "lr": 0.01}},
        },
    },
    "evaluation": {
        "joint_size": 48,
        "split_size": 24,
        "validation_size": 16,
        "lengths": [4, 6, 12],
        "length_size": 24,
        "batch_size": 64,
        "greedy_check": 8,
    },
    "merges": {
        "linear": {},
        "task_arithmetic": {"lam": [0.5, 1.0]},
        "ties": {"lam": [1.0], "density": [0.5]},
        "dare_ties": {"lam": [1.0], "drop_rate": [0.5]},
    },
}
SYSTEMS = {
    "base",
    "expert:ab",
    "expert:ab:lora",
    "expert:cd",
    "expert:cd:lora",
    "expert:ac",
    "expert:ac:lora",
    "compose",
    "compose:lora",
    "merge:linear",
    "merge:task_arithmetic",
    "merge:ties",
    "merge:dare_ties",
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compare")
    config_path = folder / "small.yaml"
    config_path.write_text(yaml.safe_dump(SMALL))
    config = load_config(config_path)
    out_dir = folder / "run"
    started = time.perf_counter()
    results = run_compare(config, out_dir, progress=False, echo=None)
    return config, config_path, out_dir, results, time.perf_counter() - started


def test_writes_every_output(small_run):
    config, _, out_dir, results, _ = small_run
    assert {path.name for path in out_dir.iterdir()} >= {
        "results.json",
        "results.md",
        "length.png",
        "config.yaml",
        "checkpoints",
    }
    assert json.loads((out_dir / "results.json").read_text()) == json.loads(json.dumps(results))
    assert load_config(out_dir / "config.yaml") == config  # the resolved config, loadable as is
    assert (out_dir / "length.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (out_dir / "results.md").read_text()
    assert "| merge:ties" in markdown and "## Bars" in markdown


def test_results_schema(small_run):
    config, _, _, results, _ = small_run
    assert results["config"] == config.model_dump(mode="json")
    assert set(results["systems"]) == SYSTEMS
    sizes = {"joint": 48, "ab": 24, "cd": 24, "neither": 24, "length_12": 24}
    for _name, record in results["systems"].items():
        assert set(record["splits"]) == set(sizes)
        for split, cell in record["splits"].items():
            assert cell["n"] == sizes[split]
            low, high = cell["ci95"]
            assert 0 <= low <= cell["exact_match"] <= high <= 1
        assert list(record["by_length"]) == ["4", "6", "12"]
        assert all(0 <= value <= 1 for value in record["by_length"].values())
    targets = {name: record["target"] for name, record in results["systems"].items()}
    assert targets["base"] == "copy" and targets["expert:ac:lora"] == "skill:ac"
    assert targets["compose"] == targets["merge:ties"] == "joint"
    # The joint curve at the main length and beyond is scored on the test splits themselves.
    compose = results["systems"]["compose"]
    assert compose["by_length"]["6"] == compose["splits"]["joint"]["exact_match"]
    assert compose["by_length"]["12"] == compose["splits"]["length_12"]["exact_match"]


def test_greedy_decoding_agrees_everywhere(small_run):
    _, _, _, results, _ = small_run
    for name, record in results["systems"].items():
        assert [check["split"] for check in record["greedy_check"]] == ["joint", "length_12"]
        for check in record["greedy_check"]:
            assert check["agree"] == check["n"] == 8, name
    # The check means something: the composition gets joint strings right when decoding for real.
    assert results["systems"]["compose"]["greedy_check"][0]["greedy_exact_match"] > 0.5


def test_merges_chosen_on_validation(small_run):
    config, _, _, results, _ = small_run
    assert set(results["merges"]) == set(config.merges)
    for method, record in results["merges"].items():
        grid = config.merges[method].candidates()
        assert [{k: v for k, v in row.items() if k != "mean_exact_match"} for row in record["validation"]] == grid
        best = max(row["mean_exact_match"] for row in record["validation"])
        assert record["validation_exact_match"] == best
        first_best = next(row for row in record["validation"] if row["mean_exact_match"] == best)
        assert record["chosen"] == {k: v for k, v in first_best.items() if k != "mean_exact_match"}


def test_checkpoints_are_transformers_and_peft_folders(small_run):
    _, _, _, results, _ = small_run
    paths = results["checkpoints"]
    for folder in [paths["base"], *paths["experts"].values()]:
        assert {"config.json", "model.safetensors", "tokenizer.json", "training.json"} <= {
            p.name for p in Path(folder).iterdir()
        }
    for folder in paths["adapters"].values():
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in Path(folder).iterdir()}
    assert all(record["cached"] is False for record in results["training"].values())


def test_lora_per_skill_retrains_only_that_adapter(small_run, tmp_path):
    config, _, out_dir, results, _ = small_run
    data = config.model_dump(mode="json")
    override = {**data["training"]["experts"]["lora"], "rank": 2}
    data["training"]["experts"]["lora_per_skill"] = {"cd": override}
    changed = CompareConfig.model_validate(data)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to(out_dir / "checkpoints", target_is_directory=True)
    components = prepare_components(changed, run_dir, progress=False)
    cached = {label: record["cached"] for label, record in components.training.items()}
    assert cached == {label: label != "lora-cd" for label in results["training"]}
    before = {name: Path(path).name for name, path in results["checkpoints"]["adapters"].items()}
    assert components.adapters["ab"].name == before["ab"] and components.adapters["ac"].name == before["ac"]
    assert components.adapters["cd"].name != before["cd"]
    adapter_config = json.loads((components.adapters["cd"] / "adapter_config.json").read_text())
    assert adapter_config["r"] == 2
    # Without overrides the dump (and so the config hash) is what it was before the field existed.
    assert "lora_per_skill" not in config.model_dump(mode="json")["training"]["experts"]


def test_bars_are_reported(small_run):
    _, _, _, results, _ = small_run
    bars = results["bars"]
    assert any(bar["bar"].startswith("base on copy at length 4") for bar in bars)
    joint = next(bar for bar in bars if bar["bar"].startswith("compose on joint at length 6"))
    assert joint["applies"] is False  # 48 strings, fewer than the 1,000 the bar asks for
    assert all(bar["passed"] == (bar["applies"] and bar["value"] >= 0.99) for bar in bars)


def test_cached_rerun_through_the_cli(small_run, capsys):
    config, config_path, out_dir, results, first_seconds = small_run
    stamps = {path: path.stat().st_mtime_ns for path in (out_dir / "checkpoints").rglob("*") if path.is_file()}
    assert main(["compare", str(config_path), "--out", str(out_dir), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "| compose" in printed and "joint (n=48)" in printed
    again = json.loads((out_dir / "results.json").read_text())
    assert all(record["cached"] for record in again["training"].values())
    assert all(record["cached"] for record in again["merges"].values())
    assert {path: path.stat().st_mtime_ns for path in stamps} == stamps  # nothing retrained or rewritten
    for name, record in again["systems"].items():
        assert record["splits"] == results["systems"][name]["splits"]
        assert record["by_length"] == results["systems"][name]["by_length"]


def test_a_compare_reads_its_config_once_and_checks_once(small_run, monkeypatch):
    """`mergecompose compare`: the config file is opened once, and the pre-flight runs once."""
    _, config_path, out_dir, _, _ = small_run
    opened, checks = [], []
    real_open, real_preflight = io.open, compare_module.preflight_compare

    def counting_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and Path(os.fspath(file)).resolve() == config_path.resolve():
            opened.append(file)
        return real_open(file, *args, **kwargs)

    def counting_preflight(*args, **kwargs):
        checks.append(args)
        return real_preflight(*args, **kwargs)

    monkeypatch.setattr(io, "open", counting_open)
    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(compare_module, "preflight_compare", counting_preflight)
    monkeypatch.setattr(experiments_cli, "preflight_compare", counting_preflight)
    assert main(["compare", str(config_path), "--out", str(out_dir), "--quiet"]) == 0
    assert len(opened) == 1 and len(checks) == 1
    # The check counts: run from Python, the library checks for itself.
    run_compare(load_config(config_path), out_dir, progress=False, echo=None)
    assert len(opened) == 2 and len(checks) == 2


def test_refuses_a_folder_of_another_config_or_no_run(small_run, tmp_path):
    config, _, out_dir, _, _ = small_run
    other = CompareConfig.model_validate(
        {**config.model_dump(), "evaluation": {**config.evaluation.model_dump(), "seed": 7}}
    )
    with pytest.raises(FileExistsError, match="holds the results of another config"):
        run_compare(other, out_dir, progress=False, echo=None)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a compare run folder"):
        run_compare(config, tmp_path, progress=False, echo=None)


def test_a_folder_left_by_a_run_killed_before_its_results_is_taken_again(small_run, tmp_path):
    """config.yaml is written before results.json: a run killed between them leaves it beside the checkpoints."""
    config, _, out_dir, results, _ = small_run
    out = tmp_path / "killed"
    shutil.copytree(out_dir / "checkpoints", out / "checkpoints")
    shutil.copyfile(out_dir / "config.yaml", out / "config.yaml")
    again = run_compare(config, out, progress=False, echo=None)
    assert all(record["cached"] for record in again["training"].values())
    assert {name: record["splits"] for name, record in again["systems"].items()} == {
        name: record["splits"] for name, record in results["systems"].items()
    }


def test_aligned_from_scratch_and_a_results_section(tmp_path):
    """The paper's setup in miniature: tagging, experts trained alone, no merges; a section hook."""
    config = CompareConfig.model_validate(
        {
            "name": "aligned",
            "task": {"formulation": "aligned", "train_lengths": [6, 6]},
            "positions": {"scheme": "contiguous", "randomize": False, "max_position": 8},
            "model": {"architecture": "gpt2", "hidden_size": 32, "max_position_embeddings": 8},
            "training": {
                "base": {"epochs": 1, "num_examples": 64, "batch_size": 8, "lr": 0.003},
                "experts": {"init": "scratch", "full": {"epochs": 1, "num_examples": 64, "batch_size": 8, "lr": 0.003}},
            },
            "evaluation": {
                "joint_size": 16,
                "split_size": 8,
                "validation_size": 4,
                "lengths": [4, 6, 8],
                "length_size": 8,
            },
            "merges": {},
        }
    )
    seen = {}
    results = run_compare(
        config,
        tmp_path / "run",
        progress=False,
        echo=None,
        sections={"extra": lambda context: seen.setdefault("systems", sorted(context.systems))},
    )
    assert set(results["systems"]) == {"base", "expert:ab", "expert:cd", "expert:ac", "compose"}
    assert set(results["skipped"]) == {
        "merge:linear",
        "merge:task_arithmetic",
        "merge:ties",
        "merge:dare_ties",
        "compose:lora",
    }
    assert results["merges"] == {} and results["checkpoints"]["adapters"] == {}
    assert all(record["greedy_check"] == [] for record in results["systems"].values())  # tagging: no decoding
    assert results["extra"] == seen["systems"] == sorted(results["systems"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokens": 3}, "Extra inputs are not permitted"),
        ({"merges": {"slerp": {}}}, "unknown merge methods"),
        (
            {"training": {**SMALL["training"], "experts": {"init": "scratch", "full": {"steps": 1}}}},
            "merges need experts fine-tuned",
        ),
        ({"task": {"formulation": "aligned"}}, "scheme: coupled` is for seq2seq"),
        ({"positions": {"max_position": 10}}, "too small for strings of length 12"),
        (
            {"task": {"skills": {"ab": {"A": "B"}, "cd": {"C": "D"}}, "joint": ["ab", "ac"]}},
            "two or more distinct skills",
        ),
        (
            {"training": {"base": {"steps": 1, "epochs": 1}, "experts": SMALL["training"]["experts"]}},
            "give either `steps`",
        ),
        (
            {
                "training": {
                    **SMALL["training"],
                    "experts": {
                        **SMALL["training"]["experts"],
                        "lora_per_skill": {"xy": SMALL["training"]["experts"]["lora"]},
                    },
                }
            },
            r"`training.experts.lora_per_skill` names unknown skills \['xy'\]; valid: \['ab', 'cd', 'ac'\]",
        ),
        (
            {
                "training": {
                    **SMALL["training"],
                    "experts": {"full": {"steps": 1}, "lora_per_skill": {"ab": SMALL["training"]["experts"]["lora"]}},
                }
            },
            "overrides `lora`, which is not set",
        ),
        # The whole merge grid is validated at load time, before any training.
        ({"merges": {"ties": {"lam": [1.0], "density": [0.2, 1.5]}}}, r"`density` must be in \(0, 1\], got 1.5"),
        ({"merges": {"dare_ties": {"drop_rate": [1.0]}}}, "drop_rate"),
        ({"task": {"type": "sorting"}}, r"unknown task type 'sorting'; valid: \['letters', 'skills'\]"),
        ({"variants": {"contiguous": {"positions": {"scheme": "diagonal"}}}}, r"`variants.contiguous`: .*scheme"),
        ({"variants": {"bad-name": {}}}, "variant names must be identifiers"),
    ],
)
def test_config_errors_name_the_field(tmp_path, change, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**SMALL, **change}))
    with pytest.raises(ValueError, match=message):
        load_config(path)


def test_a_variant_adds_its_systems_and_the_contrast_and_changes_no_main_number(small_run, tmp_path):
    """A variant (contiguous positions, no LoRA) reuses the main checkpoints and leaves every main number as it was."""
    _, _, main_dir, main_results, _ = small_run
    data = {
        **SMALL,
        "variants": {
            "contiguous": {
                "positions": {"scheme": "contiguous", "randomize": False},
                "training": {"experts": {"lora": None}},
            }
        },
    }
    config = CompareConfig.model_validate(data)
    out_dir = tmp_path / "run"
    results = _run_on_the_main_checkpoints(config, main_dir, out_dir)

    variant_systems = {f"contiguous/{name}" for name in SYSTEMS if ":lora" not in name}
    assert set(results["systems"]) == SYSTEMS | variant_systems
    for name in SYSTEMS:
        assert results["systems"][name]["splits"] == main_results["systems"][name]["splits"], name
        assert results["systems"][name]["by_length"] == main_results["systems"][name]["by_length"], name
    assert all(record["cached"] for record in results["training"].values())  # nothing of the main setting retrained
    assert not any(record["cached"] for record in results["variants"]["contiguous"]["training"].values())

    contrast = results["contrast"]
    assert contrast["settings"] == ["main", "contiguous"]
    assert set(contrast["systems"]) == {
        "compose",
        "compose:lora",
        "merge:linear",
        "merge:task_arithmetic",
        "merge:ties",
        "merge:dare_ties",
    }
    assert "contiguous" not in contrast["systems"]["compose:lora"]
    cell = contrast["systems"]["merge:ties"]["contiguous"]
    compose = contrast["systems"]["compose"]["contiguous"]
    assert cell == {
        k: results["systems"]["contiguous/merge:ties"]["splits"]["joint"][k] for k in ("exact_match", "ci95", "n")
    }
    disjoint = cell["ci95"][1] < compose["ci95"][0] or cell["ci95"][0] > compose["ci95"][1]
    assert contrast["differs"]["contiguous"]["merge:ties"] == disjoint
    markdown = (out_dir / "results.md").read_text()
    assert "## Merging against composing" in markdown and "contiguous (n=48)" in markdown
    assert (out_dir / "length.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_remedy_of_ones_own_is_a_system_of_the_compare(small_run, tmp_path):
    """A remedy set `{class: user_remedies:Scale, alpha: 1.0}` (a user's module outside the package) is evaluated as
    `compose+same`: multipliers of 1 leave the rule as it is, so every number is the plain composition's; the resolved
    config names the class and its module's hash."""
    _, _, main_dir, main_results, _ = small_run
    config = CompareConfig.model_validate(
        {**SMALL, "remedies": {"same": {"class": "user_remedies:Scale", "alpha": 1.0}}}
    )
    out_dir = tmp_path / "run"
    results = _run_on_the_main_checkpoints(config, main_dir, out_dir)
    assert set(results["systems"]) == SYSTEMS | {"compose+same"}
    same, plain = results["systems"]["compose+same"], main_results["systems"]["compose"]
    assert same["splits"] == plain["splits"] and same["by_length"] == plain["by_length"]
    (entry,) = results["config"]["remedies"]["same"]["custom"]
    assert entry["class"] == "user_remedies:Scale" and entry["alpha"] == 1.0 and len(entry["source_sha256"]) == 64
    assert load_config(out_dir / "config.yaml") == config  # the resolved config loads back as the same config


def _run_on_the_main_checkpoints(config: CompareConfig, main_dir: Path, out_dir: Path) -> dict:
    """`run_compare` into `out_dir`, with the main run's trained components linked in as its cache."""
    (out_dir / "checkpoints").mkdir(parents=True)
    for folder in (main_dir / "checkpoints").iterdir():
        if folder.is_dir():
            (out_dir / "checkpoints" / folder.name).symlink_to(folder)
    return run_compare(config, out_dir, progress=False, echo=None)
