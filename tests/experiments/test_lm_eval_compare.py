"""`type: lm_eval` compares: two evaluation paths give one answer, cells resume, merges are chosen and built, bad
input is refused.

A scaled-down native letters run with contiguous positions (lm-eval passes no position ids) is
trained once; the lm_eval compare then scores its systems through lm-eval (`hf` and `composed`)
on tiny tasks made from the strings that run scored.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from mergecompose.cli import main
from mergecompose.composition import RemedySettings
from mergecompose.experiments.compare import run_compare
from mergecompose.experiments.compare_config import CompareConfig, load_config
from mergecompose.experiments.evaluate import wilson_interval
from mergecompose.experiments.lm_eval import LmEvalCompareConfig
from mergecompose.experiments.lm_eval.lm_eval_compare import run_lm_eval_compare
from mergecompose.experiments.lm_eval.lm_eval_systems import build_merge, composition_systems, plan_merge, slug
from mergecompose.experiments.lm_eval.native_run import prompt_text, write_generate_task
from mergecompose.experiments.plugins import compare_kinds, register_compare_kind
from mergecompose.experiments.tokenizer import build_tokenizer
from mergecompose.merging import TaskVector
from mergecompose.studies.letters.letters_task_type import LettersTaskSettings

NATIVE = {
    "name": "small_contiguous",
    "task": {"skills": {"ab": {"A": "B"}, "cd": {"C": "D"}}, "joint": ["ab", "cd"], "train_lengths": [1, 6]},
    "positions": {"scheme": "contiguous", "randomize": False, "max_position": 48},
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "max_position_embeddings": 48},
    "training": {  # short, so that the numbers differ between systems and splits (0 – 100 %)
        "base": {"steps": 400, "batch_size": 64, "lr": 0.003, "schedule": "cosine", "warmup_fraction": 0.1},
        "experts": {
            "full": {"steps": 60, "batch_size": 64, "lr": 0.002, "schedule": "cosine", "warmup_fraction": 0.1},
            "lora": {
                "rank": 4,
                "alpha": 8,
                "training": {"steps": 60, "batch_size": 64, "lr": 0.01, "schedule": "cosine", "warmup_fraction": 0.1},
            },
        },
    },
    "evaluation": {
        "joint_size": 48,
        "split_size": 24,
        "validation_size": 16,
        "lengths": [4, 6],
        "length_size": 16,
        "batch_size": 64,
        "greedy_check": 0,
    },
    "merges": {"linear": {}, "task_arithmetic": {"lam": [0.5, 1.0]}, "ties": {"lam": [1.0], "density": [0.5]}},
}
SPLITS = ["joint", "ab", "cd", "neither"]
# Merges whose mergekit definition is the native one (TIES's is not: per-tensor trim, weighted election).
SAME_DEFINITION = {"merge:linear", "merge:task_arithmetic"}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def native_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("native") / "run"
    results = run_compare(CompareConfig.model_validate(NATIVE), out_dir, progress=False, echo=None)
    return out_dir, results


def lm_eval_data(native_dir, **changes) -> dict:
    return {
        "name": "small_lm_eval",
        "task": {"type": "lm_eval"},
        "native_run": {"folder": str(native_dir), "splits": SPLITS, "choice_split": "joint"},
        "batch_size": 64,
        **changes,
    }


@pytest.fixture(scope="module")
def lm_eval_run(native_run, tmp_path_factory):
    native_dir, _ = native_run
    folder = tmp_path_factory.mktemp("lm_eval")
    (folder / "config.yaml").write_text(yaml.safe_dump(lm_eval_data(native_dir)))
    config = load_config(folder / "config.yaml")  # dispatched on task.type
    results = run_compare(config, folder / "run", progress=False, echo=None)  # dispatched on the config's class
    return config, folder / "run", results


def test_two_paths_one_answer(native_run, lm_eval_run):
    """Every system's exact match through lm-eval equals the native run's, split by split, on the same strings."""
    _, native = native_run
    _, _, results = lm_eval_run
    systems = {
        "base",
        "expert:ab",
        "expert:cd",
        "expert:ab:lora",
        "expert:cd:lora",
        "compose",
        "compose:lora",
        "merge:linear",
        "merge:task_arithmetic",
        "merge:ties",
    }
    assert set(results["systems"]) == systems == set(native["systems"])
    compared = 0
    for name in systems - {"merge:ties"}:
        for split in SPLITS:
            ours = results["systems"][name]["splits"][f"letters_{split}/exact_match"]
            theirs = native["systems"][name]["splits"][split]
            assert (ours["exact_match"], ours["n"]) == (theirs["exact_match"], theirs["n"]), (name, split)
            assert ours["ci95"] == pytest.approx(theirs["ci95"])
            compared += 1
    assert compared == 9 * 4
    # The equality means something: the numbers differ between systems and splits.
    values = {
        record["splits"][f"letters_{split}/exact_match"]["exact_match"]
        for record in results["systems"].values()
        for split in SPLITS
    }
    assert len(values) >= 8 and any(0 < value < 1 for value in values)
    joint = {
        name: record["splits"]["letters_joint/exact_match"]["exact_match"]
        for name, record in results["systems"].items()
    }
    assert joint["base"] == 0.0 and joint["compose"] > 0.5
    # The merges are the native run's chosen hyperparameters.
    assert {method: record["chosen"] for method, record in results["merges"].items()} == {
        method: record["chosen"] for method, record in native["merges"].items()
    }


def test_with_the_papers_merge_definitions_every_system_is_equal(native_run, lm_eval_run, tmp_path):
    """`merge_definitions: paper` builds the merges as the native run does, so TIES is equal too."""
    native_dir, native = native_run
    _, run_dir, _ = lm_eval_run
    shutil.copytree(run_dir / "cells", tmp_path / "run" / "cells")  # base, experts, compositions: reused by key
    config = LmEvalCompareConfig.model_validate(lm_eval_data(native_dir, merge_definitions="paper"))
    results = run_compare(config, tmp_path / "run", progress=False, echo=None)
    assert set(results["systems"]) == set(native["systems"])
    for name in native["systems"]:
        for split in SPLITS:
            ours = results["systems"][name]["splits"][f"letters_{split}/exact_match"]
            assert ours["exact_match"] == native["systems"][name]["splits"][split]["exact_match"], (name, split)
    built = sorted(
        path.name.split("-")[1] for path in (tmp_path / "run" / "cache").iterdir() if path.name.startswith("merge-")
    )
    assert built == ["linear", "task_arithmetic", "ties"]


def test_on_ray_the_cells_give_the_local_results(lm_eval_run, tmp_path):
    """`--executor ray` on a local Ray instance of 2 CPUs: the same results.json, timings and where cells ran aside;
    the cells ran in Ray's workers."""
    ray = pytest.importorskip("ray")
    from mergecompose.integrations.ray import RayExecutor

    config, local_folder, local = lm_eval_run
    executor = RayExecutor(num_cpus=2)
    try:
        on_ray = run_compare(config, tmp_path / "run", progress=False, echo=None, executor=executor)
    finally:
        ray.shutdown()

    def without_timings(results, folder):
        """The results without timings and where cells ran, the run folder's own path as <run>."""
        results = json.loads(json.dumps(results).replace(str(folder), "<run>"))
        results = {key: value for key, value in results.items() if key not in ("timings", "executor")}
        results["systems"] = {
            name: {key: value for key, value in system.items() if key != "seconds"}
            for name, system in results["systems"].items()
        }
        return results

    assert without_timings(on_ray, tmp_path / "run") == without_timings(local, local_folder)
    assert on_ray["executor"]["name"] == "ray" and local["executor"]["name"] == "local"
    runs = on_ray["executor"]["runs"]
    assert len(runs) == len(on_ray["systems"]) * len(on_ray["tasks"]) + 1 + len(on_ray["merges"])
    assert {run["pid"] for run in runs.values()}.isdisjoint({os.getpid()})


def test_results_files_and_schema(lm_eval_run):
    config, out_dir, results = lm_eval_run
    assert {path.name for path in out_dir.iterdir()} >= {
        "results.json",
        "results.md",
        "bars.png",
        "config.yaml",
        "cells",
        "samples",
        "cache",
        "lm_eval_tasks",
    }
    assert json.loads((out_dir / "results.json").read_text()) == json.loads(json.dumps(results))
    assert load_config(out_dir / "config.yaml") == config  # the resolved config, loadable as is
    assert (out_dir / "bars.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| compose:lora" in (out_dir / "results.md").read_text()
    sizes = {"joint": 48, "ab": 24, "cd": 24, "neither": 24}
    for _name, record in results["systems"].items():
        assert set(record["splits"]) == {f"letters_{split}/exact_match" for split in SPLITS} | {
            "letters_joint_choice/acc"
        }
        for split, cell in record["splits"].items():
            n = sizes[split.split("/")[0].removeprefix("letters_").removesuffix("_choice")]
            assert cell["n"] == n and cell["interval"] == "wilson"
            assert cell["ci95"] == pytest.approx(list(wilson_interval(round(cell["value"] * n), n)))
        for task, files in record["samples"].items():  # lm-eval's per-sample log of every system and task
            lines = (out_dir / files[task]).read_text().splitlines()
            assert len(lines) == sizes[task.removeprefix("letters_").removesuffix("_choice")]
            assert {"doc", "resps", "filtered_resps", "target"} <= set(json.loads(lines[0]))
    assert results["systems"]["compose"]["model"] == "composed"
    assert results["systems"]["merge:ties"]["model"] == "hf"


def test_the_multiple_choice_task_scores_log_likelihoods(lm_eval_run):
    _, out_dir, results = lm_eval_run
    accuracy = {
        name: record["splits"]["letters_joint_choice/acc"]["value"] for name, record in results["systems"].items()
    }
    assert accuracy["base"] < accuracy["compose"]  # the base prefers the copy
    sample = json.loads(
        (out_dir / results["systems"]["base"]["samples"]["letters_joint_choice"]["letters_joint_choice"])
        .read_text()
        .splitlines()[0]
    )
    choices, label = sample["doc"]["choices"], sample["doc"]["label"]
    copy = choices.index(sample["doc"]["source"] + "<eos>")
    assert max(range(3), key=lambda index: sample["filtered_resps"][index][0]) == copy != label


def test_letters_tokenizer_reads_the_prompt_text():
    """The literal `<eos>` and `<sep>` of the prompt text are the tokenizer's special ids, as in the native format."""
    tokenizer = build_tokenizer("ABCDEFGHIJKLMNOPQRSTUVWXYZ ")
    ids = tokenizer(prompt_text("AB C"), add_special_tokens=False)["input_ids"]
    vocab = tokenizer.get_vocab()
    assert ids == [vocab["A"], vocab["B"], vocab[" "], vocab["C"], tokenizer.eos_token_id, tokenizer.sep_token_id]
    choices, label = LettersTaskSettings().lm_eval_choices("CAB")
    assert choices[label] == "DBB" and sorted(choices) == sorted(["DBB", "CAB", "CBB"])


def test_a_killed_run_recomputes_only_the_missing_cell(lm_eval_run, tmp_path):
    config, out_dir, results = lm_eval_run
    copy = tmp_path / "run"
    shutil.copytree(out_dir, copy)
    (copy / "results.json").unlink()  # killed before the end
    (copy / "cells" / "compose" / "letters_ab.json").unlink()
    # The resolved config beside the results loads from anywhere (its paths are absolute); a config inside --out
    # is refused as an input the run could overwrite, so it is run from a copy.
    shutil.copy(copy / "config.yaml", tmp_path / "config.yaml")
    assert main(["compare", str(tmp_path / "config.yaml"), "--out", str(copy), "--quiet"]) == 0
    rerun = json.loads((copy / "results.json").read_text())
    assert rerun["cells"]["evaluated"] == [["compose", "letters_ab"]]
    assert len(rerun["cells"]["reused"]) == len(results["cells"]["evaluated"]) - 1
    assert {name: record["splits"] for name, record in rerun["systems"].items()} == {
        name: record["splits"] for name, record in results["systems"].items()
    }


def test_merge_grid_chosen_on_a_validation_split(native_run, tmp_path):
    """Two λ tried on the validation split of a task (its test split replaced), the better kept on disk."""
    native_dir, native = native_run
    config = CompareConfig.model_validate(NATIVE)
    data = config.task.eval_data(config.evaluation, config.eval_length, config.task.train_lengths[1])
    tasks = tmp_path / "tasks"
    write_generate_task(tasks, "held_out", list(zip(data.test["joint"].sources, data.test["joint"].targets)), 8)
    write_generate_task(
        tasks, "validation", list(zip(data.validation["joint"].sources, data.validation["joint"].targets)), 8
    )
    task = yaml.safe_load((tasks / "held_out.yaml").read_text())
    task["dataset_kwargs"]["data_files"]["validation"] = str((tasks / "validation.jsonl").resolve())
    (tasks / "held_out.yaml").write_text(yaml.safe_dump(task))
    (tasks / "validation.yaml").unlink()
    checkpoints = native["checkpoints"]
    lm_config = LmEvalCompareConfig.model_validate(
        {
            "task": {"type": "lm_eval", "names": ["held_out"], "include_path": str(tasks), "limit": 8},
            "base": checkpoints["base"],
            "experts": checkpoints["experts"],
            "merges": {"task_arithmetic": {"lam": [0.5, 1.0]}},
            "merge_selection": {"task": "held_out", "split": "validation", "metric": "exact_match"},
            "batch_size": 16,
        }
    )
    results = run_compare(lm_config, tmp_path / "run", progress=False, echo=None)
    record = results["merges"]["task_arithmetic"]
    scores = [entry["score"] for entry in record["validation"]]
    assert [entry["params"] for entry in record["validation"]] == [{"lam": 0.5}, {"lam": 1.0}]
    assert record["chosen"] == record["validation"][scores.index(max(scores))]["params"]
    assert sorted(path.name.split("-")[1] for path in (tmp_path / "run" / "cache").iterdir()) == ["task_arithmetic"]
    assert scores[0] == pytest.approx(
        _exact_match(tmp_path / "run", "merge:task_arithmetic@lam=0.5", data.validation["joint"])
    )
    assert set(results["systems"]) == {"base", "expert:ab", "expert:cd", "merge:task_arithmetic"}
    assert results["systems"]["base"]["splits"]["held_out/exact_match"]["n"] == 8


def _exact_match(run_dir, system, eval_set) -> float:
    """Exact match of a selection cell's samples against `eval_set`'s targets, read from lm-eval's own log."""
    lines = (run_dir / "samples" / slug(system) / "held_out.jsonl").read_text().splitlines()
    samples = [json.loads(line) for line in lines]
    assert [sample["doc"]["source"] for sample in samples] == list(eval_set.sources)
    return sum(sample["filtered_resps"][0] == sample["target"] for sample in samples) / len(samples)


def test_lora_experts_are_merged_from_their_delta_weights(native_run, tmp_path):
    native_dir, native = native_run
    checkpoints = native["checkpoints"]
    adapters = {f"{name}:lora": path for name, path in checkpoints["adapters"].items()}
    config = LmEvalCompareConfig.model_validate(
        {
            "task": {"type": "lm_eval", "names": ["held_out"], "include_path": str(_one_task(tmp_path))},
            "base": checkpoints["base"],
            "experts": adapters,
            "merges": {"task_arithmetic": {"lam": [0.7]}},
        }
    )
    build = plan_merge(config, "task_arithmetic", {"lam": 0.7}, tmp_path / "cache")
    merged = AutoModelForCausalLM.from_pretrained(build_merge(config, build, tmp_path / "cache"))
    base = AutoModelForCausalLM.from_pretrained(checkpoints["base"])
    expected = sum(TaskVector.from_lora(base, path) for path in adapters.values()) * 0.7
    expected = expected.apply_to(base.state_dict())
    for name, tensor in merged.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=1e-5, msg=name)
    assert any(not torch.equal(tensor, base.state_dict()[name]) for name, tensor in merged.state_dict().items())
    assert (build.folder / "tokenizer.json").is_file()  # the base's tokenizer, through the dense experts

    # A cached merge cut short (a full disk, a killed copy) is named and built again, not loaded.
    weights = build.folder / "model.safetensors"
    half = weights.read_bytes()[: weights.stat().st_size // 2]
    weights.unlink()  # a new file: `merged` above still maps the old one
    weights.write_bytes(half)
    with pytest.warns(
        UserWarning, match=r"cached checkpoint merge-task_arithmetic-\w+ cannot be reused \(.*model\.safetensors"
    ):
        build_merge(config, build, tmp_path / "cache")
    rebuilt = AutoModelForCausalLM.from_pretrained(build.folder).state_dict()
    for name, tensor in rebuilt.items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=1e-5, msg=name)


def _one_task(tmp_path):
    folder = tmp_path / "one_task"
    write_generate_task(folder, "held_out", [("AB", "BB")], 4)
    return folder


# ---------------------------------------------------------------------------------- bad input


def test_an_unknown_task_is_refused_at_load_with_how_to_list_them(native_run, tmp_path):
    native_dir, native = native_run
    path = tmp_path / "bad.yaml"
    path.write_text(
        yaml.safe_dump({"task": {"type": "lm_eval", "names": ["gsm8k_cott"]}, "base": native["checkpoints"]["base"]})
    )
    with pytest.raises(
        ValueError, match=r"knows no task named \['gsm8k_cott'\].*gsm8k_cot.*mergecompose lm-eval ls tasks"
    ):
        load_config(path)


def test_a_missing_adapter_folder_is_refused_at_load(native_run, tmp_path):
    _, native = native_run
    data = {
        "task": {"type": "lm_eval", "names": ["held_out"], "include_path": str(_one_task(tmp_path))},
        "base": native["checkpoints"]["base"],
        "experts": {"ab": str(tmp_path / "no_such_adapter")},
    }
    with pytest.raises(ValueError, match=r"experts.ab.*'.*no_such_adapter': no such folder"):
        LmEvalCompareConfig.model_validate(data)
    data["experts"] = {"ab": str(tmp_path)}  # a folder, but no checkpoint or adapter
    with pytest.raises(ValueError, match="it has no config.json and no adapter_config.json"):
        LmEvalCompareConfig.model_validate(data)


def test_code_tasks_need_the_opt_in(tmp_path, capsys):
    """The paper's config runs code tasks; without `allow_code_execution` it is refused in one line, before any
    model."""
    data = yaml.safe_load(open("configs/gemma2_mergebench.yaml"))
    data["allow_code_execution"] = False
    path = tmp_path / "no_opt_in.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["compare", str(path), "--out", str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "['humaneval_plus', 'mbpp_plus'] execute model-written code" in error
    assert "allow_code_execution: true" in error
    assert not (tmp_path / "run").exists()


def test_the_paper_config_loads(tmp_path):
    config = load_config("configs/gemma2_mergebench.yaml")
    assert isinstance(config, LmEvalCompareConfig)
    assert config.task.names == ["humaneval_plus", "mbpp_plus", "gsm8k_cot", "minerva_math"]
    assert (config.base, config.experts) == (
        "google/gemma-2-2b",
        {"math": "MergeBench/gemma-2-2b_math", "coding": "MergeBench/gemma-2-2b_coding"},
    )
    assert config.allow_code_execution and config.dtype == "bfloat16" and config.device == "cuda"
    assert config.task.gen_kwargs == {"do_sample": False}
    assert set(config.merges) == {"task_arithmetic", "ties"} and config.merge_selection.split == "train"


def test_offline_a_hub_id_outside_the_cache_is_refused_when_the_run_starts(tmp_path, monkeypatch):
    """The config loads anywhere (its hub ids have the right form); the run refuses them at once, before any work."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = load_config("configs/gemma2_mergebench.yaml")
    with pytest.raises(
        ValueError, match=r"`base` 'google/gemma-2-2b' is not a local folder, so it is a hub id, and HF_HUB_OFFLINE"
    ):
        run_lm_eval_compare(config, tmp_path / "run", echo=None)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"merges": {"magnitude_prune": {"density": [0.5]}}}, "mergekit, which does not run"),
        ({"merges": {"ties": {"lam": [1.0], "density": [1.5]}}}, "density"),
        ({"merges": {"task_arithmetic": {"lam": [0.5, 1.0]}}}, "needs `merge_selection`"),
        (
            {"compositions": {"compose": {"experts": ["ab", "zz"]}}},
            "`compositions.compose.experts` must name experts of `experts`",
        ),
        ({"compositions": {"merge:x": {"experts": ["ab"]}}}, "keys are system names"),
        ({"compositions": {"both": {"experts": ["ab"], "remedies": {"gate": -1}}}}, "gate"),
        ({"device": "gpu"}, "`device` must be"),
        ({"task": {"type": "lm_eval", "names": ["held_out"], "limit": 0}}, "limit"),
    ],
)
def test_config_errors_name_the_field(native_run, tmp_path, change, message):
    _, native = native_run
    data = {
        "task": {"type": "lm_eval", "names": ["held_out"], "include_path": str(_one_task(tmp_path))},
        "base": native["checkpoints"]["base"],
        "experts": {"ab": native["checkpoints"]["experts"]["ab"]},
    }
    if "task" in change:
        change["task"]["include_path"] = data["task"]["include_path"]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**data, **change}))
    with pytest.raises(ValueError, match=message):
        load_config(path)


def test_a_composition_with_a_remedy_of_ones_own_carries_it_to_lm_eval(native_run, tmp_path):
    """`compositions.*.remedies` may name a user's remedy: lm-eval's model gets it in the string form `parse` reads
    back, and the system's identity (its cache key) holds the module's hash."""
    _, native = native_run
    data = {
        "task": {"type": "lm_eval", "names": ["held_out"], "include_path": str(_one_task(tmp_path))},
        "base": native["checkpoints"]["base"],
        "experts": {"ab": native["checkpoints"]["experts"]["ab"]},
        "compositions": {"mine": {"experts": ["ab"], "remedies": {"class": "user_remedies:Scale", "alpha": 0.5}}},
    }
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    config = load_config(path)
    system = composition_systems(config)["mine"]
    assert system.load.model_args["remedies"] == "termination_threshold:0.1;class:user_remedies:Scale;alpha:0.5"
    assert RemedySettings.parse(system.load.model_args["remedies"]) == config.compositions["mine"].remedies
    (entry,) = system.identity["remedies"]
    assert entry["class"] == "user_remedies:Scale" and len(entry["source_sha256"]) == 64


def test_a_user_merge_method_is_merged_in_memory(native_run, tmp_path):
    """`merges:` may name a user's method (tests/extensions/user_merges.py): mergekit does not run it, so its merge is
    built in memory, θ_base + λ · (the task vector of larger L2 norm) per tensor, checked here by hand; its folder's key
    holds the module's hash."""
    _, native = native_run
    checkpoints = native["checkpoints"]
    data = {
        "task": {"type": "lm_eval", "names": ["held_out"], "include_path": str(_one_task(tmp_path))},
        "base": checkpoints["base"],
        "experts": checkpoints["experts"],
        "merges": {"user_merges:largest_task_vector": {"lam": [0.5]}},
    }
    config = LmEvalCompareConfig.model_validate(data)
    build = plan_merge(config, "user_merges:largest_task_vector", {"lam": 0.5}, tmp_path / "cache")
    assert build.folder.name.startswith("merge-user_merges_largest_task_vector-")
    folder = build_merge(config, build, tmp_path / "cache")
    merged = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    base = AutoModelForCausalLM.from_pretrained(checkpoints["base"]).state_dict()
    experts = [AutoModelForCausalLM.from_pretrained(path).state_dict() for path in checkpoints["experts"].values()]
    for name, tensor in base.items():
        if not tensor.is_floating_point():
            continue
        deltas = [expert[name] - tensor for expert in experts]
        largest = max(deltas, key=lambda delta: delta.norm().item())
        torch.testing.assert_close(merged[name], tensor + 0.5 * largest, rtol=0, atol=1e-6)
    assert (folder / "tokenizer_config.json").is_file()  # the base's tokenizer travels with the merge


def test_a_compare_kind_is_registered_once():
    assert compare_kinds()["lm_eval"].config is LmEvalCompareConfig
    with pytest.raises(ValueError, match="already registered"):
        register_compare_kind("lm_eval", LmEvalCompareConfig, lambda *args, **kwargs: {})
    with pytest.raises(ValueError, match="already registered"):
        register_compare_kind("letters", LmEvalCompareConfig, lambda *args, **kwargs: {})


def test_the_former_letters_run_key_is_read_as_native_run_with_a_warning(native_run, tmp_path):
    native_dir, _ = native_run
    data = lm_eval_data(native_dir)
    (tmp_path / "new.yaml").write_text(yaml.safe_dump(data))
    data["letters_run"] = data.pop("native_run")
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(data))
    with pytest.warns(FutureWarning, match="`letters_run` is now `native_run`"):
        old = load_config(tmp_path / "old.yaml")
    assert old == load_config(tmp_path / "new.yaml")
    assert old.native_run.folder == str(native_dir)


def test_a_native_run_of_a_task_type_without_choices_refuses_a_choice_split(native_run, monkeypatch):
    native_dir, _ = native_run
    # A task type that gives no multiple choices (the skills type gives none): its choice task cannot be written.
    monkeypatch.delattr(LettersTaskSettings, "lm_eval_choices")
    with pytest.raises(ValueError, match=r"gives no multiple choices; set `choice_split: null`"):
        LmEvalCompareConfig.model_validate(lm_eval_data(native_dir))
    config = LmEvalCompareConfig.model_validate(
        lm_eval_data(native_dir, native_run={"folder": str(native_dir), "splits": SPLITS, "choice_split": None})
    )
    assert config.native_run.choice_split is None
