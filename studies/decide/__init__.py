"""`mergecompose decide`: merge or compose these experts, measured on a labelled joint task, stopping as soon as an
anytime-valid sequential rule decides (`decide_run`); the task file and its scorers (`joint_task`)."""

from mergecompose.studies.decide.decide_run import DecideConfig, PreparedDecide, run_decide
from mergecompose.studies.decide.joint_task import SCORERS, joint_task_records, load_scorer, read_task

__all__ = ["SCORERS", "DecideConfig", "PreparedDecide", "joint_task_records", "load_scorer", "read_task", "run_decide"]
