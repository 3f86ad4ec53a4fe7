"""Models built on one attention switch (`ttt.models.attention.attention`)."""

from .attention import ATTENTION_BACKENDS, attention
from .mlp import MLP, MLPConfig
from .transformer import Transformer, TransformerConfig

__all__ = ["ATTENTION_BACKENDS", "attention", "MLP", "MLPConfig", "Transformer", "TransformerConfig"]
