"""The letter-replacement task type (the paper's toy experiment) and its overlap sweep.

mergecompose.studies.letters.task                 skills as data, splits, sampling (pure string functions)
mergecompose.studies.letters.letters_task_type    `task: {type: letters}`: training strings and evaluation data
mergecompose.studies.letters.overlap              overlap diagnostics of letter-expert pairs (a compare results section)
mergecompose.studies.letters.overlap_sweep        `mergecompose overlap-sweep`: overlap against composition, merge error
mergecompose.studies.letters.overlap_sweep_stats  Spearman correlations, 2×2 tables, scatter plots
"""

from mergecompose.studies.letters.letters_task_type import LettersTaskSettings
from mergecompose.studies.letters.task import LetterTask, apply_replacements

__all__ = ["LetterTask", "LettersTaskSettings", "apply_replacements"]
