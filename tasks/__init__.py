"""Synthetic tasks and `mergecompose compare`: one generic pipeline, task types registered by name.

    tasks.registry         the `TaskType` protocol and `TASK_TYPES` (register_task_type)
    tasks.config           the typed compare config (`load_config`)
    tasks.strings          the held-out rule, the rejection sampler, training batches
    tasks.tokenizer        the character-level transformers tokenizer
    tasks.formats          aligned / seq2seq model inputs, position coupling, random positions
    tasks.models           small Llama / GPT-2 models and their LoRA config
    tasks.components       base and experts, trained or loaded from the run folder's cache
    tasks.evaluate         systems, exact match with Wilson intervals, greedy decoding
    tasks.merge_selection  the merge-grid search on validation data
    tasks.remedies         remedy sets of a compare config
    tasks.compare          the whole comparison (`run_compare`)
    tasks.report           results.md, terminal tables, length.png
    tasks.letters/         the letter-replacement task type
    tasks.skills/          the sequential-skills task type
"""

from tasks.config import CompareConfig, load_config
from tasks.registry import TASK_TYPES, TaskType, get_task_type, register_task_type

# Each task type registers itself on import.
from tasks.letters import LetterTask, LettersTaskSettings, apply_replacements  # noqa: E402
from tasks.skills import SkillsTaskSettings  # noqa: E402
from tasks.compare import run_compare  # noqa: E402

__all__ = [
    "TASK_TYPES",
    "CompareConfig",
    "LetterTask",
    "LettersTaskSettings",
    "SkillsTaskSettings",
    "TaskType",
    "apply_replacements",
    "get_task_type",
    "load_config",
    "register_task_type",
    "run_compare",
]
