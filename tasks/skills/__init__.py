"""The sequential-skills task type: k experts, each active only inside its own marked segment.

    tasks.skills.spec      skills, markers and transforms as data; rewriting and sampling (pure)
    tasks.skills.settings  `task: {type: skills}`: training strings, evaluation data, noisy experts
    tasks.skills.analysis  the failure analysis results section (termination, first errors, noise)
    tasks.skills.sweep     `mergecompose skills-sweep`: accuracy against k, with each remedy
"""

from tasks.skills.settings import SkillsTaskSettings
from tasks.skills.spec import SkillsTaskSpec

__all__ = ["SkillsTaskSettings", "SkillsTaskSpec"]
