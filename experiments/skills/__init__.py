"""The sequential-skills task type: k experts, each active only inside its own marked segment.

mergecompose.experiments.skills.spec      skills, markers and transforms as data; rewriting and sampling (pure)
mergecompose.experiments.skills.settings  `task: {type: skills}`: training strings, evaluation data, noisy experts
mergecompose.experiments.skills.analysis  the failure analysis results section (termination, first errors, noise)
mergecompose.experiments.skills.sweep     `mergecompose skills-sweep`: accuracy against k, with each remedy
"""

from mergecompose.experiments.skills.settings import SkillsTaskSettings
from mergecompose.experiments.skills.spec import SkillsTaskSpec

__all__ = ["SkillsTaskSettings", "SkillsTaskSpec"]
