"""Real settings on SmolLM2: one-skill LoRA experts, pairs of them, and the merge-or-compose outcome of each.

mergecompose.studies.skill_pairs.skill_data     the skills' items by split (disjoint templates) and joint items
mergecompose.studies.skill_pairs.skill_scoring  strict and lenient scores, per part and joint
mergecompose.studies.skill_pairs.skill_experts  the cached one-skill experts and their bar
mergecompose.studies.skill_pairs.setting_run    one setting: its systems, the choices on validation, the label
mergecompose.studies.skill_pairs.real_sweep     `mergecompose real-sweep`: every stage, resumable (the experts and the
                                                sweep need the real-model and lm-eval extras: import them from their
                                                modules; this package's surface, the data and scorers, needs neither)
"""

from mergecompose.studies.skill_pairs.skill_data import (
    CONTENT_SKILLS,
    FORMAT_SKILLS,
    SKILLS,
    SkillItem,
    joint_items,
    skill_items,
)
from mergecompose.studies.skill_pairs.skill_scoring import ItemScore, score_item

__all__ = [
    "CONTENT_SKILLS",
    "FORMAT_SKILLS",
    "SKILLS",
    "ItemScore",
    "SkillItem",
    "joint_items",
    "score_item",
    "skill_items",
]
