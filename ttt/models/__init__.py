"""Models built on one attention switch (`ttt.models.attention.attention`)."""

from .attention import ATTENTION_BACKENDS, attention
from .gpt2 import GPT2, GPT2Config
from .mlp import MLP, MLPConfig
from .pretrained import from_pretrained
from .transformer import Transformer, TransformerConfig

__all__ = [
    "ATTENTION_BACKENDS",
    "GPT2",
    "GPT2Config",
    "MLP",
    "MLPConfig",
    "Transformer",
    "TransformerConfig",
    "attention",
    "from_pretrained",
]
