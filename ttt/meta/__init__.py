"""The Lightning side: `OuterLearner` (the outer step of every learner), `MetaLearner` (subclass it to
define inner and outer losses; `adapt` and `predict` once trained), `TaskDataModule` (tasks or text from
seeded streams), and loading a trained learner without a Trainer (loading.py: `ttt.load`)."""

from .data import IndexedSampler, StepAlignedSampler, SyntheticTasks, TaskDataModule, held_out_tasks
from .learner import OuterLearner
from .module import MetaLearner

__all__ = [
    "IndexedSampler",
    "MetaLearner",
    "OuterLearner",
    "StepAlignedSampler",
    "SyntheticTasks",
    "TaskDataModule",
    "held_out_tasks",
]
