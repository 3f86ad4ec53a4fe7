"""The Lightning side: `OuterLearner` (the outer step of every learner), `MetaLearner` (subclass it to
define inner and outer losses) and `TaskDataModule` (tasks or text from seeded streams)."""

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
