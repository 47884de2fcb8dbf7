"""The letter-replacement task type (the paper's toy experiment) and its overlap sweep.

    tasks.letters.task         skills as data, splits, sampling (pure string functions)
    tasks.letters.settings     `task: {type: letters}`: training strings and evaluation data
    tasks.letters.overlap      overlap diagnostics of letter-expert pairs (a compare results section)
    tasks.letters.sweep        `mergecompose overlap-sweep`: overlap against composition and merge error
    tasks.letters.sweep_stats  Spearman correlations, 2×2 tables, scatter plots
"""

from tasks.letters.settings import LettersTaskSettings
from tasks.letters.task import LetterTask, apply_replacements

__all__ = ["LetterTask", "LettersTaskSettings", "apply_replacements"]
