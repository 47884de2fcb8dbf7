"""The letter-replacement task type (the paper's toy experiment) and its overlap sweep.

mergecompose.experiments.letters.task         skills as data, splits, sampling (pure string functions)
mergecompose.experiments.letters.settings     `task: {type: letters}`: training strings and evaluation data
mergecompose.experiments.letters.overlap      overlap diagnostics of letter-expert pairs (a compare results section)
mergecompose.experiments.letters.sweep        `mergecompose overlap-sweep`: overlap against composition and merge error
mergecompose.experiments.letters.sweep_stats  Spearman correlations, 2×2 tables, scatter plots
"""

from mergecompose.experiments.letters.settings import LettersTaskSettings
from mergecompose.experiments.letters.task import LetterTask, apply_replacements

__all__ = ["LetterTask", "LettersTaskSettings", "apply_replacements"]
