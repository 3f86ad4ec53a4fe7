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
    data = TaskDataModule.from_trainer(
        lambda rng: sample_sinusoid(cfg.task, rng), seed=cfg.seed, trainer=cfg.trainer
    )
    return learner, data
