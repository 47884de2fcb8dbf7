"""The real-model workload the benchmarks share: a base checkpoint and its experts.

`--model` is a checkpoint folder (or hub id) or a registry name (`smollm2-135m-instruct`, fetched into the
cache by `mergecompose fetch-model` on first use). `--expert DIR …` gives the experts: peft adapters of that
base, or full checkpoints. Without `--expert`, two LoRA adapters of rank 8 on all seven projections are
trained from the base for a few steps, one on the study's math train split and one on its code train split
(`BENCHMARK_RECIPES`), and cached by recipe as the study's experts are: the benchmark runs before, or
without, the real study.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from mergecompose.core.boundary import check_checkpoint, check_model_or_adapter
from mergecompose.integrations.gguf.fetch import MODELS, cache_root, fetch_model
from mergecompose.studies.math_code.experts import ExpertRecipe, train_expert

# Rank 8 (alpha 16) on all seven projections, 8 steps of 4 conversations: LoRA factors that are trained, not random.
BENCHMARK_RECIPES = [
    ExpertRecipe(skill=skill, rank=8, alpha=16.0, examples=32, steps=8, batch_size=4, warmup_steps=0, autocast=None)
    for skill in ("math", "code")
]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help=f"a real base: a checkpoint folder or hub id, or a registry name ({', '.join(MODELS)}); "
        "default: seeded random models",
    )
    parser.add_argument(
        "--expert",
        nargs="+",
        action="extend",
        default=None,
        metavar="DIR",
        help="the experts of --model (adapters or full checkpoints), repeated (--expert A --expert B) as in the "
        "commands, or several after one flag; default: two LoRA adapters of rank 8 trained here for a few steps "
        "(benchmarks/real_model.py)",
    )


def real_workload(model: str, experts: list[str] | None, *, progress: bool = True) -> tuple[str, list[str]]:
    """The base's checkpoint folder (or hub id) and its experts' sources, fetched or trained if needed."""
    base = str(fetch_model(model)) if model in MODELS else model
    base = str(check_checkpoint(base, "--model"))
    if experts:
        for expert in experts:
            check_model_or_adapter(expert, "--expert")
        return base, [str(expert) for expert in experts]
    cache = cache_root()
    if not os.path.isdir(base):
        raise ValueError(f"--model: training the default experts needs a local checkpoint folder, got {model!r}")
    trained = [train_expert(base, recipe, cache, progress=progress) for recipe in BENCHMARK_RECIPES]
    return base, [str(Path(folder)) for folder in trained]
