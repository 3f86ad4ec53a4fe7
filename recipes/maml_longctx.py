"""maml_longctx: meta-learned test-time training on long-context key-value recall.

A sliding-window transformer cannot see the key-value pairs from the queries (the filler is longer
than its receptive field); the inner loop trains the adapted weights (by default the last block's
MLP) on the context's next-token loss, chunk by chunk, and the outer loss asks for the values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from ttt.config import RecipeConfig
from ttt.inner import InnerLoopConfig
from ttt.learners import ContextChunksConfig, ContextLearner
from ttt.meta import TaskDataModule
from ttt.models import Transformer, TransformerConfig
from ttt.models.hf_causal_lm import TransformersModelConfig, load_causal_lm
from ttt.tasks import KVRecallConfig, sample_kv_recall, sample_kv_recall_at_step


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
    transformers: TransformersModelConfig = field(default_factory=TransformersModelConfig)
    """transformers.checkpoint=DIR: train that transformers causal LM instead of `model`."""

    def __post_init__(self):
        if self.transformers.checkpoint is None:
            check_model_fits_task(self.model, self.task, "model")


def check_model_fits_task(model, task: KVRecallConfig, where: str) -> None:
    """model (window, n_layers, vocab_size) must not reach the pairs from the queries and must cover
    the task's vocabulary; `where` names the config section in the error."""
    if model.window is None:
        raise ValueError(
            f"{where}: every layer needs a sliding window for maml_longctx (full attention sees the pairs)"
        )
    reach = model.n_layers * (model.window - 1)
    if task.filler_len < reach:
        raise ValueError(
            f"task.filler_len ({task.filler_len}) must be >= {where} n_layers * (window - 1) "
            f"= {reach}, or the queries could attend to the pairs without any adaptation"
        )
    if model.vocab_size < task.vocab_size:
        raise ValueError(
            f"{where} vocab_size ({model.vocab_size}) must be >= the task's vocabulary "
            f"({task.vocab_size} = 2 + n_filler_tokens + n_keys + n_values)"
        )


def build(cfg: Config) -> tuple[ContextLearner, TaskDataModule]:
    """The learner (a fresh Transformer, or the transformers checkpoint) and the task stream of `cfg`."""
    if cfg.transformers.checkpoint is None:
        model = Transformer(cfg.model)
    else:
        model = load_causal_lm(cfg.transformers)
        check_model_fits_task(model.cfg, cfg.task, f"transformers.checkpoint={cfg.transformers.checkpoint}")
    learner = ContextLearner(
        model,
        cfg.inner,
        cfg.optim,
        cfg.trainer.max_steps,
        context_len=cfg.task.context_len,
        chunks=cfg.context,
    )
    curriculum = partial(sample_kv_recall_at_step, cfg.task) if cfg.task.has_curriculum else None
    data = TaskDataModule.from_trainer(
        partial(sample_kv_recall, cfg.task), seed=cfg.seed, trainer=cfg.trainer, train_curriculum=curriculum
    )
    return learner, data
