"""maml_sinusoid: the classic MAML regression benchmark, the framework's sanity recipe."""

from __future__ import annotations

from dataclasses import dataclass, field

from ttt.config import RecipeConfig
from ttt.inner import InnerLoopConfig
from ttt.learners import RegressionLearner
from ttt.meta import TaskDataModule
from ttt.models import MLP, MLPConfig
from ttt.tasks import SinusoidConfig, sample_sinusoid


@dataclass
class Config(RecipeConfig):
    """maml_sinusoid: MLP, sinusoid task and inner loop, plus the common sections."""

    model: MLPConfig = field(default_factory=MLPConfig)
    """The regression MLP."""
    task: SinusoidConfig = field(default_factory=SinusoidConfig)
    """The sinusoid task distribution."""
    inner: InnerLoopConfig = field(default_factory=InnerLoopConfig)
    """The inner loop."""


def build(cfg: Config) -> tuple[RegressionLearner, TaskDataModule]:
    """The learner (a fresh MLP) and the task stream of `cfg`."""
    learner = RegressionLearner(MLP(cfg.model), cfg.inner, cfg.optim, cfg.trainer.max_steps)
    data = TaskDataModule(
        lambda rng: sample_sinusoid(cfg.task, rng),
        seed=cfg.seed,
        meta_batch_size=cfg.trainer.meta_batch_size,
        steps_per_epoch=cfg.trainer.steps_per_epoch,
        val_tasks=cfg.trainer.val_tasks,
        test_tasks=cfg.trainer.test_tasks,
        eval_batch_size=cfg.trainer.eval_batch_size,
        num_workers=cfg.trainer.num_workers,
    )
    return learner, data
