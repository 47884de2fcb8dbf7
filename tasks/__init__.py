"""Synthetic tasks: letter replacement (the paper's toy experiment), its trainer, and `mergecompose compare`.

    tasks.letters     skills as data, splits, held-out strings (pure string functions)
    tasks.tokenizer   the character-level transformers tokenizer
    tasks.formats     aligned / seq2seq model inputs, position coupling, random positions
    tasks.train       the trainer (from scratch, full fine-tune, LoRA)
    tasks.components  base and experts, trained or loaded from the run folder's cache
    tasks.evaluate    the systems, exact match with Wilson intervals, greedy check
    tasks.compare     the whole comparison (`run_compare`), results sections
"""

from tasks.config import CompareConfig, load_config
from tasks.letters import LetterTask, apply_replacements, is_held_out


def __getattr__(name: str):
    # run_compare pulls in transformers, peft and the merging package: import it on first use.
    if name == "run_compare":
        from tasks.compare import run_compare

        return run_compare
    raise AttributeError(f"module 'tasks' has no attribute {name!r}")


__all__ = ["CompareConfig", "LetterTask", "apply_replacements", "is_held_out", "load_config", "run_compare"]
