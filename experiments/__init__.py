"""`mergecompose compare`: one generic pipeline; task types and compare kinds plug in by name (entry points).
The studies that use it live in `mergecompose.studies`, which this package never imports.

mergecompose.experiments.plugins           the `TaskType` protocol; task types and compare kinds (entry points)
mergecompose.experiments.compare_config    the typed compare config (`load_config`)
mergecompose.experiments.training_strings  the held-out rule, the rejection sampler, training batches
mergecompose.experiments.tokenizer         the character-level transformers tokenizer
mergecompose.experiments.formats           aligned / seq2seq model inputs, position coupling, random positions
mergecompose.experiments.models            small Llama / GPT-2 models and their LoRA config
mergecompose.experiments.trained_models    base and experts, trained or loaded from the run folder's cache
mergecompose.experiments.scored_systems    what a compare scores (`System`: a name, how to load it) and their names
mergecompose.experiments.evaluate          exact match with Wilson intervals, greedy decoding
mergecompose.experiments.merge_selection   the merge-grid search, shared by every compare and sweep
mergecompose.experiments.run_folder        a run's results folder: claimed, locked, stages timed, written atomically
mergecompose.experiments.compare           the whole comparison (`run_compare`)
mergecompose.experiments.compare_report    results.md, terminal tables, length.png
mergecompose.experiments.lm_eval/          `type: lm_eval`: given checkpoints scored by lm-evaluation-harness
"""

from mergecompose.experiments.compare import run_compare
from mergecompose.experiments.compare_config import CompareConfig, load_config
from mergecompose.experiments.plugins import TaskType, get_task_type, register_task_type, task_types

__all__ = [
    "CompareConfig",
    "TaskType",
    "get_task_type",
    "load_config",
    "register_task_type",
    "task_types",
    "run_compare",
]
