"""The deep pre-flight of a `type: lm_eval` compare: what the last step needs, checked before the first model loads.

The config's own validation checks its structure and that lm-eval knows each task. `check_before_work`
checks, loading no model and writing nothing, what was otherwise found when first used, often after
merges were built and other systems evaluated:

* every local model folder through the loading boundary (`mergecompose.core.boundary`: config.json,
  weights and tokenizer files checked, nothing loaded); offline, every hub id in the hub cache;
* `device`: CUDA (or MPS) present on this machine; `dtype: bfloat16` where the device has no fast bfloat16
  kernels is kept, with a warning (`mergecompose.core.precision`);
* one vocabulary for every composition and merge: each expert's `vocab_size` (its config.json, or for a
  peft adapter its base's) against the base's, from the files, without loading weights;
* the task files under `include_path` (they parse, and have lm-eval's fields);
* `gen_kwargs`, and the generation settings of the tasks a composition is scored on, that the composed
  model supports (`mergecompose.integrations.lm_eval.harness_model.GENERATION_KWARGS`);
* `merge_selection.metric`: a metric the selection task reports (from its `metric_list`);
* each task whose data is local, built by lm-eval (its files and splits read), and `task.num_fewshot` (or the
  task's own `num_fewshot`) no more than the documents lm-eval draws the examples from; a hub dataset is not
  downloaded for this.

`mergecompose compare --check` runs it alone (`preflight`, registered with the compare kind);
`run_lm_eval_compare` runs it first.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

from mergecompose.core.boundary import check_checkpoint, check_model_or_adapter
from mergecompose.core.cli_common import check_free_disk
from mergecompose.core.precision import slow_dtype_problem
from mergecompose.core.sources import ADAPTER_CONFIG, CONFIG, is_local
from mergecompose.experiments.compare_config import fingerprint
from mergecompose.experiments.lm_eval.catalog import check_task_files, leaf_configs, metric_names, task_kind
from mergecompose.experiments.lm_eval.lm_eval_config import LmEvalCompareConfig, check_hub_sources
from mergecompose.experiments.run_folder import FolderLayout, RunFolder
from mergecompose.integrations.lm_eval.harness_model import GENERATION_KWARGS
from mergecompose.integrations.lm_eval.quiet import quiet_lm_eval


def check_before_work(config: LmEvalCompareConfig, config_path: str | os.PathLike | None = None) -> None:
    """Raise a ValueError naming the field (and `config_path`, the config's file, when given) for anything the run
    would fail on later; load no model, write nothing."""
    try:
        check_sources(config)
        check_device(config.device)
        slow = slow_dtype_problem(config.dtype, config.device, "dtype")
        if slow is not None:
            warnings.warn(slow, UserWarning, stacklevel=2)
        check_vocabularies(config)
        check_task_files(config.include_paths())
        manager = config.check_tasks()
        if manager is not None:
            check_generation_settings(config, manager)
            check_selection_metric(config, manager)
            check_local_tasks(config, manager)
    except ValueError as error:
        if config_path is None:
            raise
        raise ValueError(f"{config_path}: {error}") from None


def preflight(config: LmEvalCompareConfig, out_dir, overwrite: bool = False, config_path=None) -> None:
    """The compare kind's pre-flight (`mergecompose.experiments.plugins.CompareKind.preflight`): the run folder is
    new, this config's or replaceable, and `check_before_work`."""
    RunFolder(Path(out_dir), LM_EVAL_FOLDER).check(fingerprint(config), overwrite)
    check_before_work(config, config_path)
    merges = sum(len(list(grid.candidates())) for grid in config.merges.values())
    size = checkpoint_bytes(config.base)
    if merges and size:
        check_free_disk(out_dir, merges * size, f"the {merges} merges of this comparison (each the size of the base)")


def checkpoint_bytes(source: str) -> int:
    """The bytes of a local checkpoint's weight files (safetensors or .bin), 0 for a hub id (its size is unknown
    here without a download)."""
    folder = Path(source).expanduser()
    if not folder.is_dir():
        return 0
    return sum(path.stat().st_size for pattern in ("*.safetensors", "*.bin") for path in folder.glob(pattern))


# What a run folder may hold besides results.json before it counts as someone else's folder.
_RUN_ENTRIES = ("config.yaml", "lm_eval_tasks", "cache", "cells", "samples", "results.md", "bars.png")
LM_EVAL_FOLDER = FolderLayout("an lm_eval compare folder", cached=_RUN_ENTRIES, leftovers=("cache", "cells"))


def check_device(device: str) -> None:
    """`device` ('cpu', 'cuda', 'cuda:N', 'mps') exists on this machine; the error says what the machine has."""
    if device.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device.partition(":")[2] or 0)
        if index >= count:
            has = f"CUDA devices cuda:0 to cuda:{count - 1}" if count else "no CUDA device"
            raise ValueError(
                f"`device` is {device!r} but this machine has {has} (torch {torch.__version__}, built with CUDA "
                f"{torch.version.cuda or 'none'}); set `device: cpu`" + (" or a CUDA device it has" if count else "")
            )
    elif device == "mps" and not torch.backends.mps.is_available():
        raise ValueError("`device` is 'mps' but this machine has no MPS device; set `device: cpu`")


def check_sources(config: LmEvalCompareConfig) -> None:
    """Every local model folder is what it is used as (a checkpoint, or an adapter) and its files check out
    (`mergecompose.core.boundary`); offline, every hub id is in the hub cache."""
    if is_local(config.base):
        check_checkpoint(config.base, "base", adapter_hint="give its base as `base` and the adapter under `experts`")
    for name, source in config.experts.items():
        if is_local(source):
            check_model_or_adapter(source, f"experts.{name}")
    check_hub_sources(config)


def check_vocabularies(config: LmEvalCompareConfig) -> None:
    """Every expert that is composed or merged has the base's vocabulary size (read from config.json files)."""
    used: dict[str, list[str]] = {}
    for system, composition in config.compositions.items():
        for expert in composition.experts:
            used.setdefault(expert, []).append(f"composition {system!r}")
    for expert in config.merged_experts() if config.merges else []:
        used.setdefault(expert, []).append("the merges")
    base = vocabulary_size(config.base)
    if base is None:
        return
    for expert, where in used.items():
        source = config.experts[expert]
        size = vocabulary_size(source)
        if size is not None and size != base:
            raise ValueError(
                f"expert {expert!r} ({source!r}, used in {' and '.join(where)}) has a vocabulary of {size} ids, "
                f"the base {config.base!r} {base}; composing or merging needs one vocabulary: use experts "
                "fine-tuned from this base"
            )


def vocabulary_size(source: str) -> int | None:
    """`vocab_size` of a local checkpoint's config.json (or, for a peft adapter, its local base's); None where it
    cannot be read without the hub or a model load (a hub id, a config without it)."""
    if not is_local(source):
        return None
    folder = Path(source).expanduser()
    if (folder / ADAPTER_CONFIG).is_file():
        base = _json(folder / ADAPTER_CONFIG).get("base_model_name_or_path")
        return vocabulary_size(base) if isinstance(base, str) and base else None
    config = _json(folder / CONFIG)
    size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return size if isinstance(size, int) else None


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # not readable here: the loading boundary names what is wrong with it
    return data if isinstance(data, dict) else {}


def check_generation_settings(config: LmEvalCompareConfig, manager) -> None:
    """Where a composition is scored, `task.gen_kwargs` and the named tasks' `generation_kwargs` hold only settings
    the composed model supports."""
    if not config.compositions:
        return
    unknown = sorted(set(config.task.gen_kwargs or {}) - set(GENERATION_KWARGS))
    if unknown:
        raise ValueError(
            f"`task.gen_kwargs` {unknown} are not supported by the composed model (compositions "
            f"{sorted(config.compositions)}); supported: {list(GENERATION_KWARGS)}"
        )
    for task, settings in leaf_configs(manager, config.task.names).items():
        generation = settings.get("generation_kwargs") or {}
        unknown = sorted(set(generation) - set(GENERATION_KWARGS)) if isinstance(generation, dict) else []
        if unknown:
            raise ValueError(
                f"task {task!r} sets `generation_kwargs` {unknown}, which the composed model does not support "
                f"(compositions {sorted(config.compositions)}); supported: {list(GENERATION_KWARGS)}"
            )


def check_selection_metric(config: LmEvalCompareConfig, manager) -> None:
    """`merge_selection.metric` names a metric of the selection task's `metric_list` (`metric` or
    `metric,filter`)."""
    selection = config.merge_selection
    if selection is None or selection.metric is None or task_kind(manager, selection.task) not in ("task", "py_task"):
        return
    metrics = metric_names(leaf_configs(manager, [selection.task]).get(selection.task, {}))
    if metrics is not None and selection.metric not in metrics:
        raise ValueError(
            f"`merge_selection.metric` {selection.metric!r} is not a metric of task {selection.task!r}; "
            f"it reports {metrics}"
        )


# lm-eval's loaders of local files (`dataset_path: json` with `dataset_kwargs.data_files`, ...).
_LOCAL_LOADERS = ("json", "csv", "parquet", "text", "arrow")


def check_local_tasks(config: LmEvalCompareConfig, manager) -> None:
    """Every scored task whose data is local loads in lm-eval (its data files read, its splits found), and holds at
    least the `num_fewshot` documents lm-eval samples its few-shot examples from (`task.num_fewshot`, else the
    task's own): its `fewshot_split`, else its training, validation or test documents, one more where the examples
    come from the split being scored (lm-eval leaves the scored document out). lm-eval itself would fail only once
    the run folder was claimed: with a KeyError naming the split, or "Sample larger than population" on the first
    scored document."""
    names = [*config.task.names, *([config.merge_selection.task] if config.merge_selection else [])]
    for task, settings in leaf_configs(manager, list(dict.fromkeys(names))).items():
        if not _local_data(settings):
            continue
        try:
            with quiet_lm_eval():  # a check: no dataset progress bars
                built = manager.load([task])["tasks"][task]  # lm-eval's own task: its documents as it reads them
        except (ValueError, KeyError, OSError) as error:
            raise ValueError(f"task {task!r} does not load in lm-eval: {type(error).__name__}: {error}") from None
        shots = config.task.num_fewshot if config.task.num_fewshot is not None else settings.get("num_fewshot")
        if not isinstance(shots, int) or shots <= 0:
            continue
        documents = len(list(built.fewshot_docs()))
        split = built.fewshot_cfg.split
        scored = split is not None and split == built.config.test_split  # the scored document is left out
        if shots + scored > documents:
            field = "`task.num_fewshot`" if config.task.num_fewshot is not None else f"task {task!r}'s `num_fewshot`"
            source = f"its `fewshot_split` {split!r}" if split is not None else f"its {_fallback_split(built)} split"
            raise ValueError(
                f"{field} is {shots}, but task {task!r} has {documents} documents to draw few-shot examples from "
                f"({source}{', less the document being scored' if scored else ''}); "
                f"allowed: at most {documents - scored}"
            )


def _fallback_split(task) -> str:
    """The split lm-eval draws few-shot examples from when a task names none: training, else validation, else test."""
    if task.has_training_docs():
        return "training"
    return "validation" if task.has_validation_docs() else "test"


def _local_data(settings: dict) -> bool:
    """The task reads its documents from local files (lm-eval loads them without the hub)."""
    path = settings.get("dataset_path")
    if not isinstance(path, str):
        return False
    return path in _LOCAL_LOADERS or Path(path).expanduser().is_dir()
