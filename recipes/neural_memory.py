"""neural_memory: meta-train a sliding-window transformer whose last blocks carry a Titans-style neural
memory (written by gated gradient steps while reading) on real text, then measure loss by position and
passkey retrieval with and without memory writes. Data, learner and evaluation are ttt_e2e's."""

from __future__ import annotations

from dataclasses import dataclass, field

from ttt.config import RecipeConfig
from ttt.layers import TTTConfig
from ttt.layers.neural_memory import MemoryConfig, NeuralMemoryTransformer
from ttt.learners.ttt_language_model import TTTLanguageLearner
from ttt.meta import TaskDataModule
from ttt.models import Transformer, TransformerConfig
from ttt.text.corpus import TextDataConfig
from ttt.text.long_context import LongContextEvalConfig

from .ttt_e2e import build_data, build_learner, text_tokenizer


@dataclass
class Config(RecipeConfig):
    """neural_memory: model, reading (ttt), memory, text and evaluation, plus the common sections."""

    model: TransformerConfig = field(default_factory=lambda: TransformerConfig(window=64))
    """The transformer (sliding-window attention beside the memory)."""
    ttt: TTTConfig = field(default_factory=lambda: TTTConfig(extra_mlp=False, suffix_len=2, chunk_len=64))
    """Which blocks hold a memory (the last suffix_len), the chunk length, whether the memory is written
    (enabled), warm-up of the memory learning rate, passes per batch; extra_mlp must stay false."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """The memory: variant (mac / mag), MLP depth and width, gates, order of the outer gradient."""
    data: TextDataConfig = field(default_factory=TextDataConfig)
    """The text corpus and its tokenizer."""
    eval: LongContextEvalConfig = field(default_factory=LongContextEvalConfig)
    """Loss by position and passkey retrieval after training."""

    @property
    def inner_step_keys(self) -> str:
        """The memory's write step is sized by its own keys (there is no inner section)."""
        return "memory.max_lr (and memory.grad_clip, memory.lr_init, memory.normalize_step)"


def build(cfg: Config) -> tuple[TTTLanguageLearner, TaskDataModule]:
    """A fresh neural-memory transformer and the text stream of `cfg`."""
    tokenizer = text_tokenizer(cfg.data, cfg.model)
    model = NeuralMemoryTransformer(Transformer(cfg.model), cfg.ttt, cfg.memory)
    return build_learner(cfg, model, tokenizer), build_data(cfg, tokenizer)
