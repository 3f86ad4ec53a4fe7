"""maml_longctx: meta-learned test-time training on long-context key-value recall.

A sliding-window transformer cannot see the key-value pairs from the queries (the filler is longer
than its receptive field); the inner loop trains the adapted weights (by default the last block's
MLP) on the context's next-token loss, chunk by chunk, and the outer loss asks for the values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ttt.config import RecipeConfig
from ttt.inner import InnerLoopConfig
from ttt.learners import ContextChunksConfig, ContextLearner
from ttt.meta import TaskDataModule
from ttt.models import Transformer, TransformerConfig
from ttt.tasks import KVRecallConfig, sample_kv_recall


@dataclass
class Config(RecipeConfig):
    """maml_longctx: model, task, inner loop and context chunking, plus the common sections."""

    model: TransformerConfig = field(default_factory=lambda: TransformerConfig(window=32))
    """The transformer (needs a sliding window shorter than the filler)."""
    task: KVRecallConfig = field(default_factory=KVRecallConfig)
    """The key-value recall task."""
    inner: InnerLoopConfig = field(default_factory=lambda: InnerLoopConfig(params=["layers.1.mlp.*"]))
    """The inner loop."""
    context: ContextChunksConfig = field(default_factory=ContextChunksConfig)
    """How the inner loop reads the context."""

    def __post_init__(self):
        if self.model.window is None:
            raise ValueError("model.window must be set for maml_longctx: full attention would see the pairs")
        reach = self.model.n_layers * (self.model.window - 1)
        if self.task.filler_len < reach:
            raise ValueError(
                f"task.filler_len ({self.task.filler_len}) must be >= model.n_layers * (model.window - 1) "
                f"= {reach}, or the queries could attend to the pairs without any adaptation"
            )
        if self.model.vocab_size < self.task.vocab_size:
            raise ValueError(
                f"model.vocab_size ({self.model.vocab_size}) must be >= the task's vocabulary "
                f"({self.task.vocab_size} = 2 + n_filler_tokens + n_keys + n_values)"
            )


def build(cfg: Config) -> tuple[ContextLearner, TaskDataModule]:
    """The learner (a fresh Transformer) and the task stream of `cfg`."""
    learner = ContextLearner(
        Transformer(cfg.model),
        cfg.inner,
        cfg.optim,
        cfg.schedule_steps,
        context_len=cfg.task.context_len,
        chunks=cfg.context,
    )
    data = TaskDataModule.from_trainer(
        lambda rng: sample_kv_recall(cfg.task, rng), seed=cfg.seed, trainer=cfg.trainer
    )
    return learner, data
