"""The letter-replacement task type (the paper's toy experiment) and its overlap sweep.

mergecompose.studies.letters.task         skills as data, splits, sampling (pure string functions)
mergecompose.studies.letters.settings     `task: {type: letters}`: training strings and evaluation data
mergecompose.studies.letters.overlap      overlap diagnostics of letter-expert pairs (a compare results section)
mergecompose.studies.letters.sweep        `mergecompose overlap-sweep`: overlap against composition and merge error
mergecompose.studies.letters.sweep_stats  Spearman correlations, 2×2 tables, scatter plots
"""

from mergecompose.studies.letters.settings import LettersTaskSettings
from mergecompose.studies.letters.task import LetterTask, apply_replacements

__all__ = ["LetterTask", "LettersTaskSettings", "apply_replacements"]
