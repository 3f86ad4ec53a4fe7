"""sophia_lm: pretrain a small causal language model (`ttt.models.Transformer`) on real text (by default
the Python standard library's source, read as bytes) with a Hessian optimizer (Sophia-H or AdaHessian,
optim.name) and with a first-order baseline (compare.baseline, AdamW) side by side: the same initial
weights, the same batches, the same steps; compared at equal steps and at equal training time
(`ttt.learners.optimizer_comparison`, docs/second_order.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ttt.config import OuterOptimConfig, RecipeConfig
from ttt.learners.optimizer_comparison import CompareConfig, OptimizerComparisonLearner
from ttt.meta import TaskDataModule
from ttt.models import Transformer, TransformerConfig
from ttt.text.corpus import TextDataConfig

from .ttt_e2e import build_data, text_tokenizer


@dataclass
class Config(RecipeConfig):
    """sophia_lm: model, text, the comparison, plus the common sections (optim is the Hessian optimizer)."""

    optim: OuterOptimConfig = field(default_factory=lambda: OuterOptimConfig(name="sophia_h"))
    """The Hessian optimizer (sophia_h or adahessian) and the schedule both optimizers share."""
    model: TransformerConfig = field(default_factory=TransformerConfig)
    """The language model (both optimizers start from the same initial weights)."""
    data: TextDataConfig = field(default_factory=TextDataConfig)
    """The text corpus and its tokenizer."""
    compare: CompareConfig = field(default_factory=CompareConfig)
    """The baseline optimizer and its learning rate; the Hessian estimate's probes and sequences."""


def build(cfg: Config) -> tuple[OptimizerComparisonLearner, TaskDataModule]:
    """Two copies of a fresh transformer (one per optimizer) and the text stream of `cfg`: batches
    {"tokens": (meta_batch_size, seq_len)} of the corpus's train / val / test documents."""
    tokenizer = text_tokenizer(cfg.data, cfg.model)
    if cfg.trainer.devices > 1 or cfg.trainer.strategy == "ddp":
        raise ValueError(
            "trainer.devices > 1 / trainer.strategy=ddp is not supported by sophia_lm: each of the two "
            "models' backward passes reaches only its own half of the parameters, and the Hessian "
            "estimates are per process; use one device"
        )
    if cfg.trainer.precision == "16-mixed":
        raise ValueError(
            "trainer.precision=16-mixed is not supported by sophia_lm: the baseline optimizer is stepped "
            "by the learner, outside Lightning's gradient scaler; use bf16-mixed"
        )
    if cfg.data.passkey_answer_weight != 1:
        raise ValueError(
            f"data.passkey_answer_weight={cfg.data.passkey_answer_weight} is not supported by sophia_lm: "
            "its learner takes the plain mean next-token loss; leave it at 1"
        )
    data = build_data(cfg, tokenizer)
    learner = OptimizerComparisonLearner(
        Transformer(cfg.model), cfg.optim, cfg.compare, cfg.trainer.max_steps, seed=cfg.seed
    )
    return learner, data
