"""The Lightning side: `MetaLearner` (subclass it to define inner and outer losses) and `TaskDataModule`."""

from .data import StepAlignedSampler, SyntheticTasks, TaskDataModule, held_out_tasks
from .module import MetaLearner

__all__ = ["MetaLearner", "StepAlignedSampler", "SyntheticTasks", "TaskDataModule", "held_out_tasks"]
