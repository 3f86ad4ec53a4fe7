"""ttt_pretrained: turn a pretrained Llama / Qwen2 / SmolLM2 checkpoint into a TTT-E2E model (sliding-
window attention, extra fast-weight MLPs in the last blocks, their output projections at zero so the
converted model starts as the checkpoint with a window) and meta-fine-tune it on long text.

The presets in configs/pretrained/ give each well-known checkpoint's architecture and the TTT
settings that suit it; model.checkpoint=/path/to/dir loads the weights, and the checkpoint's
config.json must describe the preset's architecture. Random weights of the architecture (smoke tests,
memory and time measurements) are built only on request, model.random_weights=true: a null checkpoint
is otherwise an error (a 16K preset on random weights is no fine-tuning, and on the CPU it runs until
the machine's memory is gone).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ttt.config import RecipeConfig
from ttt.inner import InnerLoopConfig
from ttt.layers import TransformersTTTReader, TTTConfig, TTTTransformer
from ttt.learners.ttt_language_model import TTTLanguageLearner
from ttt.meta import TaskDataModule
from ttt.models import Transformer, TransformerConfig, from_pretrained
from ttt.models.hf_causal_lm import TransformersModelConfig, load_causal_lm
from ttt.text.corpus import TextDataConfig
from ttt.text.long_context import LongContextEvalConfig
from ttt.text.tokenizer import load_tokenizer

from .ttt_e2e import build_data, build_learner

COMPARED_FIELDS = (
    "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
    "rope_theta", "rope_scaling", "norm_eps", "tie_embeddings", "qkv_bias",
)  # fmt: skip
"""Architecture fields a checkpoint must share with the preset (attention and window are ours to choose)."""


@dataclass
class PretrainedConfig:
    """A pretrained checkpoint and the architecture it must have."""

    checkpoint: str | None = None
    """Hugging Face-format directory (config.json + safetensors); null: random weights, only with
    model.random_weights=true."""
    random_weights: bool = False
    """With model.checkpoint=null, build the architecture with random weights (smoke tests, memory and
    time measurements); false: a null checkpoint is an error."""
    architecture: TransformerConfig = field(default_factory=TransformerConfig)
    """The checkpoint's architecture, with the attention backend and sliding window to run it with."""

    def __post_init__(self):
        if self.checkpoint is not None and not Path(self.checkpoint).is_dir():
            raise ValueError(
                f"model.checkpoint={self.checkpoint!r}: no such directory (expected a Hugging Face-format "
                "checkpoint directory holding config.json and model.safetensors)"
            )


@dataclass
class Config(RecipeConfig):
    """ttt_pretrained: checkpoint, test-time training, inner loop, text and evaluation."""

    model: PretrainedConfig = field(default_factory=PretrainedConfig)
    """The pretrained model."""
    ttt: TTTConfig = field(default_factory=TTTConfig)
    """Where the fast weights sit and how the context is chunked."""
    inner: InnerLoopConfig = field(
        default_factory=lambda: InnerLoopConfig(params=["layers.*.ttt_mlp.*"], lr=1.0, grad_clip=1.0)
    )
    """The inner optimizer; inner.params (globs) pick the fast weights among the suffix blocks' parameters."""
    data: TextDataConfig = field(default_factory=TextDataConfig)
    """The text corpus; data.tokenizer=checkpoint: model.checkpoint's tokenizer.json (bytes without one)."""
    eval: LongContextEvalConfig = field(default_factory=LongContextEvalConfig)
    """Loss by position and passkey retrieval after meta-fine-tuning."""
    transformers: TransformersModelConfig = field(default_factory=TransformersModelConfig)
    """transformers.checkpoint=DIR: test-time-train that transformers causal LM itself (any architecture;
    its own parameters adapt, inner.params by its names, ttt.extra_mlp=false) instead of converting
    model.checkpoint (`ttt.layers.TransformersTTTReader`; the converted path is faster)."""

    def __post_init__(self):
        if self.transformers.checkpoint is not None and self.model.checkpoint is not None:
            raise ValueError(
                "give model.checkpoint (converted into our Transformer) or transformers.checkpoint "
                "(run as it is), not both"
            )


def load_base_model(cfg: PretrainedConfig) -> Transformer:
    """The checkpoint's model (attention and window from cfg.architecture), checked against the
    architecture; a random model of the architecture when cfg.checkpoint is null."""
    arch = cfg.architecture
    if cfg.checkpoint is None:
        if not cfg.random_weights:
            raise ValueError(
                "model.checkpoint is null: give model.checkpoint=/path/to/dir (a Hugging Face-format "
                "checkpoint of model.architecture), or model.random_weights=true to build the architecture "
                "with random weights (for smoke tests and measurements; the 16K presets need a GPU)"
            )
        return Transformer(arch)
    model = from_pretrained(cfg.checkpoint, attention=arch.attention, window=arch.window)
    preset = arch.resolved()
    mismatched = [
        f"{name}: checkpoint {getattr(model.cfg, name)!r}, preset {getattr(preset, name)!r}"
        for name in COMPARED_FIELDS
        if getattr(model.cfg, name) != getattr(preset, name)
    ]
    if mismatched:
        raise ValueError(
            f"model.checkpoint={cfg.checkpoint!r} does not have the architecture of model.architecture "
            f"({'; '.join(mismatched)}); pick the preset of that checkpoint"
        )
    return model


def build_module(cfg: Config) -> TTTLanguageLearner:
    """The learner of `cfg` around the converted pretrained model (or the transformers model itself),
    without its data (`ttt.experiments.scale` feeds it random tokens)."""
    checkpoint = cfg.transformers.checkpoint or cfg.model.checkpoint
    spec = cfg.data.tokenizer
    if spec == "checkpoint":
        spec = "bytes" if checkpoint is None else checkpoint
    tokenizer = load_tokenizer(spec)
    if cfg.transformers.checkpoint is None:
        base, vocab = None, cfg.model.architecture.vocab_size
    else:
        base = load_causal_lm(cfg.transformers)
        vocab = base.cfg.vocab_size
    if vocab < tokenizer.vocab_size:
        raise ValueError(
            f"the model's vocabulary ({vocab}) is smaller than the tokenizer's ({tokenizer.vocab_size})"
        )
    if base is None:
        model = TTTTransformer(load_base_model(cfg.model), cfg.ttt, cfg.inner)
    else:
        model = TransformersTTTReader(base, cfg.ttt, cfg.inner)
    return build_learner(cfg, model, tokenizer)


def build(cfg: Config) -> tuple[TTTLanguageLearner, TaskDataModule]:
    """The converted pretrained model (or the transformers model itself) and the text stream of `cfg`."""
    learner = build_module(cfg)
    return learner, build_data(cfg, learner.tokenizer)
