"""The sequential-skills task type: k experts, each active only inside its own marked segment.

mergecompose.studies.skills.spec              skills, markers and transforms as data; rewriting and sampling (pure)
mergecompose.studies.skills.skills_task_type  `task: {type: skills}`: training strings, evaluation data, noisy experts
mergecompose.studies.skills.analysis          the failure analysis results section (termination, first errors, noise)
mergecompose.studies.skills.skills_sweep      `mergecompose skills-sweep`: accuracy against k, with each remedy
"""

from mergecompose.studies.skills.skills_task_type import SkillsTaskSettings
from mergecompose.studies.skills.spec import SkillsTaskSpec

__all__ = ["SkillsTaskSettings", "SkillsTaskSpec"]
