"""Real settings on SmolLM2: one-skill LoRA experts, pairs of them, and the merge-or-compose outcome of each.

mergecompose.studies.skill_pairs.skill_data     the skills' items by split (disjoint templates) and joint items
mergecompose.studies.skill_pairs.skill_scoring  strict and lenient scores, per part and joint
mergecompose.studies.skill_pairs.skill_experts  the cached one-skill experts and their bar
mergecompose.studies.skill_pairs.setting_run    one setting: its systems, the choices on validation, the label
mergecompose.studies.skill_pairs.real_sweep     `mergecompose real-sweep`: every stage, resumable
"""

from mergecompose.studies.skill_pairs.real_sweep import RealSweepConfig, preflight_real_sweep, run_real_sweep
from mergecompose.studies.skill_pairs.skill_data import (
    CONTENT_SKILLS,
    FORMAT_SKILLS,
    SKILLS,
    SkillItem,
    joint_items,
    skill_items,
)
from mergecompose.studies.skill_pairs.skill_experts import SkillRecipe, check_expert_bar, expert_bar
from mergecompose.studies.skill_pairs.skill_scoring import ItemScore, score_item

__all__ = [
    "CONTENT_SKILLS",
    "FORMAT_SKILLS",
    "SKILLS",
    "ItemScore",
    "RealSweepConfig",
    "SkillItem",
    "SkillRecipe",
    "check_expert_bar",
    "expert_bar",
    "joint_items",
    "preflight_real_sweep",
    "run_real_sweep",
    "score_item",
    "skill_items",
]
